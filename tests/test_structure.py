"""The code's shape, checked on the source: no import circle, no mixin, no wiring from outside, small modules.

The rules of the developers' guide and of the design's layout (the design card kept beside the
repository) that a reader of the tree relies on:

- no import circle among the modules of trainer, pserver, psproto and transpiler, imports under
  ``TYPE_CHECKING`` counted too: a module that names another only for its types still depends on
  it, and the circle is there for a reader and a type checker all the same;
- no mixin where parts are composed (the engine, the tables, the trainer's transport): a class
  has at most one base of this project, and that base is an interface (abstract) or a class that
  builds itself (defines ``__init__``);
- no attribute of another object set after its construction: a part that needs a collaborator
  gets it in its constructor, and a state it shares is moved through that state's methods;
- no module past ~400 lines and no folder past ~12 modules; one module name, one meaning;
- library code logs, it never prints: ``print`` only in a command's own output (a ``cli`` or
  ``__main__`` module, or a ``main`` function: the serving reader is one file with its command).
"""

from __future__ import annotations

import ast
import collections
import pathlib
from typing import Dict, Iterator, List, Set, Tuple

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]  # tests/ is one level below the repository
PACKAGES = {"trainer": "trainer", "pserver": "pserver", "proto": "psproto", "transpiler": "transpiler"}
GENERATED = ("ps_pb2.py", "ps_pb2_grpc.py")  # protoc's output, regenerated, never edited

MAX_LINES = 420  # "~400"
MAX_MODULES = 12  # per folder, __init__.py not counted
# Module names that mean the same thing wherever they are.
SHARED_NAMES = {"__init__", "__main__", "cli", "errors"}
# Where parts are composed: no mixins.
COMPOSED = ("pserver/engine", "pserver/tables", "trainer/transport")


def sources(folder: str = "") -> Iterator[pathlib.Path]:
    """Every hand-written module of the four packages (under ``folder`` when given)."""
    for top in PACKAGES:
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if path.name not in GENERATED and rel.startswith(folder):
                yield path


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    parts[0] = PACKAGES[parts[0]]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports(path: pathlib.Path, modules: Set[str]) -> Set[str]:
    """The project modules ``path`` imports: at import time, in a function, or under ``TYPE_CHECKING``."""
    tree = ast.parse(path.read_text(), str(path))
    me = module_name(path)
    package = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        targets: List[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(
                    package[: len(package) - node.level + 1] + ([node.module] if node.module else [])
                )
            else:
                base = node.module or ""
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for target in targets:
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in modules and target != me:
                found.add(target)
    return found


def import_circles() -> List[List[str]]:
    """Every strongly connected set of two or more modules (Tarjan), each sorted."""
    paths = {module_name(p): p for p in sources()}
    edges = {m: project_imports(p, set(paths)) for m, p in paths.items()}
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    circles: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return circles


def test_no_import_circle():
    assert import_circles() == []


def test_the_circle_finder_finds_a_circle(tmp_path, monkeypatch):
    """The check above sees circles at all: two modules that import each other are one, whether the
    import back runs (in a function) or only names a type (under ``TYPE_CHECKING``)."""
    for top in PACKAGES:
        (tmp_path / top).mkdir()
    (tmp_path / "trainer" / "__init__.py").write_text("")
    (tmp_path / "trainer" / "a.py").write_text("from .b import x\n")
    (tmp_path / "trainer" / "b.py").write_text("def f():\n    from trainer.a import y\n")
    (tmp_path / "pserver" / "c.py").write_text("from .d import Part\n")
    (tmp_path / "pserver" / "d.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .c import Whole\n"
    )
    (tmp_path / "pserver" / "e.py").write_text("from .d import Part\n")  # imports, and is not imported
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    assert import_circles() == [["pserver.c", "pserver.d"], ["trainer.a", "trainer.b"]]


def classes() -> Dict[str, Tuple[pathlib.Path, ast.ClassDef]]:
    """Every class of the four packages by name (names repeat rarely; the last one wins)."""
    found = {}
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                found[node.name] = (path, node)
    return found


def is_interface(node: ast.ClassDef, known: Dict[str, Tuple[pathlib.Path, ast.ClassDef]]) -> bool:
    """An abstract base: ABC among its bases (or its bases'), or a method marked @abstractmethod."""
    if any(
        "abstractmethod" in ast.unparse(d)
        for f in node.body
        if isinstance(f, ast.FunctionDef)
        for d in f.decorator_list
    ):
        return True
    for base in node.bases:
        name = ast.unparse(base).split(".")[-1]
        if name in ("ABC", "Protocol") or (name in known and is_interface(known[name][1], known)):
            return True
    return False


@pytest.mark.parametrize("folder", COMPOSED)
def test_no_mixin_where_parts_are_composed(folder):
    known = classes()
    mixed = []
    for path in sources(folder):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ClassDef):
                continue
            own = [ast.unparse(b).split(".")[-1] for b in node.bases]
            own = [b for b in own if b in known]

            def builds_itself(b):
                return any(isinstance(f, ast.FunctionDef) and f.name == "__init__" for f in known[b][1].body)

            if len(own) > 1 or any(
                not is_interface(known[b][1], known) and not builds_itself(b) for b in own
            ):
                mixed.append(f"{path.relative_to(REPO)}: {node.name}({', '.join(own)})")
    assert mixed == []


# Attribute writes on another object that are not wiring: torch's way to hand a tensor its
# gradient, and a counters record an object owns and alone writes.
ALLOWED_WRITES = (".grad", "self.counts.")


def writes_on_other_objects(path: pathlib.Path) -> List[str]:
    """``obj.attr = ...`` in a function where ``obj`` is a parameter or an attribute of ``self``.

    An object the function builds itself (a local) is still under construction and may be
    filled in; ``self.x = ...`` is an object's own state.
    """
    found = []
    for fn in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        params = {a.arg for a in fn.args.args + fn.args.kwonlyargs + fn.args.posonlyargs} - {"self", "cls"}
        for node in ast.walk(fn):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else ([node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            )
            for target in targets:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if not isinstance(t, ast.Attribute):
                        continue
                    root, depth = t.value, 1
                    while isinstance(root, (ast.Attribute, ast.Subscript)):
                        root, depth = root.value, depth + 1
                    text = ast.unparse(t)
                    if not isinstance(root, ast.Name) or any(a in text for a in ALLOWED_WRITES):
                        continue
                    if (root.id == "self" and depth >= 2) or root.id in params:
                        found.append(f"{path.relative_to(REPO)}:{node.lineno}: {text}")
    return found


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_attribute_of_another_object_is_set_after_its_construction(package):
    assert [w for path in sources(package) for w in writes_on_other_objects(path)] == []


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_module_past_about_400_lines(package):
    long = {
        str(p.relative_to(REPO)): n
        for p in sources(package)
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_folder_past_about_12_modules(package):
    folders = collections.Counter(
        p.parent.relative_to(REPO).as_posix()
        for p in (REPO / package).rglob("*.py")
        if p.name != "__init__.py"
    )
    assert {folder: n for folder, n in folders.items() if n > MAX_MODULES} == {}


def test_one_module_name_one_meaning():
    """A module name is used once across the packages (cli, errors and package files mean one thing
    everywhere)."""
    by_name = collections.defaultdict(list)
    for path in sources():
        if path.stem not in SHARED_NAMES:
            by_name[path.stem].append(path.relative_to(REPO).as_posix())
    assert {name: paths for name, paths in by_name.items() if len(paths) > 1} == {}


def prints_outside_a_command(path: pathlib.Path) -> List[str]:
    """``path:line`` of each ``print(...)`` outside a command's own code (see the module docstring)."""
    if path.stem in ("cli", "__main__") or path.stem.endswith("_cli"):
        return []
    tree = ast.parse(path.read_text(), str(path))
    in_main = {
        id(n)
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef) and f.name == "main"
        for n in ast.walk(f)
    }
    return [
        f"{path.relative_to(REPO)}:{n.lineno}"
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Name)
        and n.func.id == "print"
        and id(n) not in in_main
    ]


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_library_code_logs_and_never_prints(package):
    assert [p for path in sources(package) for p in prints_outside_a_command(path)] == []


def test_the_print_finder_finds_a_print(tmp_path, monkeypatch):
    """The check above sees a print at all, and only outside a command's code."""
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    (tmp_path / "pkg").mkdir()
    for name, text in {
        "lib.py": "def f():\n    print('x')\n",
        "tool.py": "def main():\n    print('x')\n",
        "cli.py": "print('x')\n",
        "stat_cli.py": "def table():\n    print('x')\n",
    }.items():
        (tmp_path / "pkg" / name).write_text(text)
    found = [
        p
        for name in ("lib.py", "tool.py", "cli.py", "stat_cli.py")
        for p in prints_outside_a_command(tmp_path / "pkg" / name)
    ]
    assert found == ["pkg/lib.py:2"]
