"""Where the repository's parts are, for tests at any depth under tests/ (the repository is harness's)."""

from __future__ import annotations

from harness.paths import REPO

EXAMPLES = REPO / "examples"
SCRIPTS = REPO / "tests" / "scripts"
