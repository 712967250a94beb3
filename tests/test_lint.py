"""The linter and the formatter pass on the whole tree (the settings are pyproject.toml's [tool.ruff]).

ruff's formatter decides how a statement is laid out, so a module's length measures its code and not how
tightly it was packed to stay under tests/test_structure.py's cap; the linter keeps the line length, the
import order and pyflakes' checks.
"""

import pathlib
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def ruff(*args: str) -> subprocess.CompletedProcess:
    """Run the ruff of this environment (the test extra installs it) on the repository."""
    exe = shutil.which("ruff", path=str(pathlib.Path(sys.executable).parent)) or shutil.which("ruff")
    if exe is None:
        pytest.fail("ruff is not installed: pip install -e '.[test]'")
    return subprocess.run([exe, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_the_linter_passes():
    out = ruff("check", "--no-cache", "--output-format", "concise", ".")
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_formatter_changes_nothing():
    out = ruff("format", "--no-cache", "--check", ".")
    assert out.returncode == 0, "run `ruff format .`:\n" + out.stdout + out.stderr
