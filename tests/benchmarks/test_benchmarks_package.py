"""benchmarks/ is a package: its modules import, import each other as ``benchmarks.*``, edit no sys.path.

The benchmarks' shared helpers exist once (in ``benchmarks/common/``, or in ``harness/`` where the tests
share them), every entry point answers ``--help``, and what they record lives in ``benchmarks/results/``.
Importing every module also catches a benchmark left behind when the library's internals it reaches
into are renamed.
"""

from __future__ import annotations

import ast
import collections
import importlib
import pathlib
import re
import time

import pytest

from tests.helpers.paths import REPO

BENCHMARKS = REPO / "benchmarks"
MODULES = sorted(BENCHMARKS.rglob("*.py"))
# `python -m benchmarks.<name>`: a module, or a package's __main__ (benchmarks/gpu_check/).
ENTRY_POINTS = sorted(p for p in BENCHMARKS.glob("*.py") if p.name != "__init__.py") + sorted(
    BENCHMARKS.glob("*/__main__.py")
)
# Helpers that were written two or three times before benchmarks/ became a package, or once in the
# benchmarks and again in the tests before both used harness/'s. free_ports is ps-launch's own.
SHARED = (
    "free_ports",
    "die_with_parent",
    "tail",
    "RunFailed",
    "busy_cpu_seconds",
    "OtherLoad",
    "cpu_model",
    "stop_on_signals",
    "peer_module",
    "EtcdServer",
    "start_etcd",
    "Processes",
    "DEFAULT_PEERS",
    "REPO",
    "pythonpath_with_repo",
    "Hosts",
    "in_ns",
    "clear_namespace",
    "Command",
    "LocalCluster",
)
# Where each is looked for: the benchmarks, what they share with the tests, the tests' helpers, ps-launch.
HELPER_MODULES = (
    MODULES
    + sorted((REPO / "harness").rglob("*.py"))
    + sorted((REPO / "tests" / "helpers").rglob("*.py"))
    + [REPO / "trainer" / "launch" / "hosts.py"]
)


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def tree(path: pathlib.Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


@pytest.mark.parametrize("path", MODULES, ids=module_name)
def test_every_benchmark_module_imports(path):
    importlib.import_module(module_name(path))


def test_no_benchmark_edits_sys_path():
    edits = [
        f"{p.relative_to(REPO)}:{n.lineno}"
        for p in MODULES
        for n in ast.walk(tree(p))
        if isinstance(n, ast.Attribute) and ast.unparse(n).startswith("sys.path.")
    ]
    assert edits == []


def test_benchmark_modules_import_each_other_as_benchmarks_x():
    bare = {p.stem for p in MODULES} - {"__init__"}
    found = []
    for p in MODULES:
        for n in ast.walk(tree(p)):
            names = (
                [a.name for a in n.names]
                if isinstance(n, ast.Import)
                else [n.module or ""]
                if isinstance(n, ast.ImportFrom) and not n.level
                else []
            )
            found += [
                f"{p.relative_to(REPO)}:{n.lineno} imports {m}" for m in names if m.split(".")[0] in bare
            ]
    assert found == []


def test_each_shared_helper_is_defined_once():
    defined = collections.Counter()
    for p in HELPER_MODULES:
        for n in tree(p).body:
            if isinstance(n, (ast.FunctionDef, ast.ClassDef)):
                defined[n.name] += 1
            elif isinstance(n, ast.Assign):
                defined.update(t.id for t in n.targets if isinstance(t, ast.Name))
    assert {name: defined[name] for name in SHARED} == {name: 1 for name in SHARED}


@pytest.mark.parametrize(
    "path", ENTRY_POINTS, ids=lambda p: p.parent.name if p.stem == "__main__" else p.stem
)
def test_every_entry_point_has_an_argument_parser_and_a_main_guard(path):
    source = path.read_text()
    assert "argparse.ArgumentParser(" in source
    assert 'if __name__ == "__main__":' in source


# <benchmark>-<YYYY-MM-DD>[-<variant>].<ext>: benchmarks/results/RESULTS.md says how results are named.
RESULT_NAME = re.compile(r"[a-z][a-z_]*-\d{4}-\d{2}-\d{2}(-[a-z0-9]+)*\.[a-z]+")


def test_result_files_are_named_by_benchmark_and_date():
    results = BENCHMARKS / "results"
    files = [p for p in results.rglob("*") if p.is_file() and "history" not in p.relative_to(results).parts]
    named = [p.relative_to(results).as_posix() for p in files if p.name != "RESULTS.md"]
    assert named, "no result files"
    assert [n for n in named if not RESULT_NAME.fullmatch(n.rsplit("/", 1)[-1])] == []


def test_a_new_run_records_under_its_benchmark_and_todays_date():
    from benchmarks.common.paths import RESULTS, dated_result

    today = time.strftime("%Y-%m-%d", time.gmtime())
    assert dated_result("peers") == str(pathlib.Path(RESULTS) / f"peers-{today}.json")
    assert dated_result("peers", "png").endswith(f"/peers-{today}.png")
    assert RESULT_NAME.fullmatch(pathlib.Path(dated_result("scaling")).name)


def test_results_live_in_their_own_folder():
    """Beside the scripts (Python, and shell wrappers such as gpu_check.sh) only the README."""
    assert (BENCHMARKS / "results" / "RESULTS.md").is_file()
    beside_scripts = sorted(
        p.name for p in BENCHMARKS.iterdir() if p.is_file() and p.suffix not in (".py", ".sh", ".md")
    )
    assert beside_scripts == []
