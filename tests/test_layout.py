"""The layout's rules, checked on the source: which package may import which."""

import ast
import pathlib
import subprocess
import sys

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # requires-python is >=3.10: the test extra installs tomli there
    import tomli as tomllib

REPO = pathlib.Path(__file__).resolve().parents[1]  # tests/ is one level below the repository


def imported_roots(package: str):
    """{(module path, top-level name)} of every import in ``package``'s modules, relative ones resolved."""
    found = set()
    for path in (REPO / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {(str(path.relative_to(REPO)), a.name.split(".")[0]) for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add((str(path.relative_to(REPO)), node.module.split(".")[0]))
    return found


@pytest.mark.parametrize(
    "package, forbidden",
    [
        ("trainer", {"pserver"}),
        ("pserver", {"trainer"}),
        ("transpiler", {"grpc", "grpc_health", "grpc_reflection", "pserver", "trainer"}),
        ("proto", {"pserver", "trainer", "transpiler"}),
    ],
)
def test_packages_import_only_what_the_layout_allows(package, forbidden):
    assert sorted((path, name) for path, name in imported_roots(package) if name in forbidden) == []


# What the tests and the benchmarks share (ports, child processes, etcd, network namespaces, the in-process
# cluster) is harness/'s: neither imports the other, the benchmarks' own tests (tests/benchmarks/) aside,
# and harness imports neither.
@pytest.mark.parametrize(
    "package, forbidden, allowed, seen",
    [
        ("benchmarks", {"tests"}, (), "harness"),
        ("tests", {"benchmarks"}, ("tests/benchmarks/",), "harness"),
        ("harness", {"tests", "benchmarks"}, (), "trainer"),
    ],
)
def test_tests_and_benchmarks_share_only_harness(package, forbidden, allowed, seen):
    found = imported_roots(package)
    assert seen in {name for _, name in found}  # the check sees imports at all
    assert (
        sorted((path, name) for path, name in found if name in forbidden and not path.startswith(allowed))
        == []
    )


# In pserver only the RPC layer (pserver/rpc/: the servicer, and the main port that builds the gRPC
# server), the operators' side (pserver/ops/: the health port, ps-stat) and server.py, which resolves
# the credentials (psproto.security), speak gRPC:
# the engines, stores, tables and checkpoints below them do not. psproto's ps_pb2_grpc and security
# import grpc themselves, so they count as gRPC too.
GRPC_ROOTS = {"grpc", "grpc_health", "grpc_reflection"}
GRPC_PSPROTO = {"psproto.ps_pb2_grpc", "psproto.security"}
GRPC_ALLOWED = ("pserver/rpc/", "pserver/ops/", "pserver/server.py")


def grpc_importers(package: str):
    """The modules of ``package`` (paths relative to the repository) that import gRPC."""
    found = set()
    for path in (REPO / package).rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        if any(n.split(".")[0] in GRPC_ROOTS or n in GRPC_PSPROTO for n in names):
            found.add(path.relative_to(REPO).as_posix())
    return found


def test_in_pserver_only_the_rpc_and_ops_layers_and_the_server_import_grpc():
    importers = grpc_importers("pserver")
    assert "pserver/rpc/service/servicer.py" in importers  # the check sees imports at all
    assert sorted(p for p in importers if not p.startswith(GRPC_ALLOWED)) == []


# In trainer only the transport speaks gRPC and reads status codes; ps-launch checks the security
# settings (psproto.security) to hand them to the roles it starts, and makes no call.
TRAINER_GRPC_ALLOWED = ("trainer/transport/", "trainer/launch/arg_checks.py")


def test_in_trainer_only_the_transport_speaks_grpc_and_reads_status_codes():
    """Recovery, node groups and steppers decide on trainer/errors.py's kinds; the transport maps codes to
    them."""
    importers = grpc_importers("trainer")
    assert "trainer/transport/status_codes.py" in importers  # the check sees imports at all
    assert (
        sorted(p for p in importers if p.startswith(("trainer/recovery/", "trainer/node/", "trainer/errors")))
        == []
    )
    assert sorted(p for p in importers if not p.startswith(TRAINER_GRPC_ALLOWED)) == []


def test_importing_every_transpiler_module_loads_no_grpc():
    modules = sorted(p.stem for p in (REPO / "transpiler").glob("*.py") if p.stem != "__init__")
    code = (
        "import sys, importlib\n"
        f"for m in {modules!r}: importlib.import_module('transpiler.' + m)\n"
        "print(sorted(n for n in sys.modules if n == 'grpc' or n.startswith('grpc.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "module",
    [
        "pserver.tables.rows",
        "pserver.tables.serving.reader",
        "pserver.engine",
        "pserver.checkpoint.layout",
        "pserver.tables",
    ],
)
def test_importing_a_pserver_helper_loads_no_grpc(module):
    """pserver/__init__.py imports ParameterServer on first use: a helper of the package needs no gRPC."""
    code = (
        f"import sys, importlib\nimportlib.import_module({module!r})\n"
        "print(sorted(n for n in sys.modules if n == 'grpc' or n.startswith('grpc.') or n == "
        "'pserver.server'))\n"
        "import pserver\nprint(pserver.ParameterServer.__module__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.splitlines() == ["[]", "pserver.server"]


def test_transpiler_exports_the_user_api():
    import transpiler

    assert sorted(transpiler.__all__) == sorted(
        [
            "Program",
            "DistributeTranspiler",
            "DistributeTranspilerConfig",
            "TableOptions",
            "RoleEnv",
            "PserverProgram",
            "StartupProgram",
            "TrainerProgram",
            "Position",
            "TableLifecycle",
        ]
    )


def test_the_package_surfaces_resolve_lazily_and_ps_launch_starts_without_torch():
    """The exports are imported on first use: every name resolves, and the launcher needs no torch."""
    code = (
        "import sys, trainer.launch, transpiler.roles.role_env\n"
        "print('torch' in sys.modules)\n"
        "import trainer, transpiler\n"
        "print([n for pkg in (trainer, transpiler) for n in pkg.__all__ if getattr(pkg, n).__name__ != n])\n"
        "try:\n    trainer.NoSuchName\nexcept AttributeError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.splitlines() == ["False", "[]", "module 'trainer' has no attribute 'NoSuchName'"]


def test_every_package_is_shipped():
    """pyproject.toml lists packages by hand: a subpackage left out installs only in editable mode."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    on_disk = {
        ".".join(p.parent.relative_to(REPO).parts)
        for top in ("transpiler", "pserver", "trainer")
        for p in (REPO / top).rglob("__init__.py")
    }
    # psproto's subpackages, under its own name (proto/ itself has no __init__.py)
    on_disk |= {
        ".".join(("psproto", *p.parent.relative_to(REPO / "proto").parts))
        for p in (REPO / "proto").rglob("__init__.py")
    }
    assert on_disk - listed == set()
    assert config["package-dir"]["psproto"] == "proto" and "psproto" in listed


# Tracked files over this size must be listed here as data (nothing is, today): a wheel, a build output or a
# data set committed by accident fails this test instead of staying in the history for good.
MAX_FILE_BYTES = 1 << 20
LISTED_DATA: frozenset = frozenset()


def tracked_files_over(limit: int):
    """(path, bytes) of every file git tracks here whose size exceeds ``limit``."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    found = []
    for name in filter(None, out.decode().split("\0")):
        path = REPO / name
        if path.is_file() and path.stat().st_size > limit:
            found.append((name, path.stat().st_size))
    return found


def test_no_tracked_file_over_1_mb_but_listed_data():
    assert [(p, n) for p, n in tracked_files_over(MAX_FILE_BYTES) if p not in LISTED_DATA] == []


def test_the_size_check_sees_tracked_files():
    """The check reads git's list: the largest tracked file is found at a limit just below its size."""
    largest = max(tracked_files_over(0), key=lambda f: f[1])
    assert tracked_files_over(largest[1] - 1) == [largest]
