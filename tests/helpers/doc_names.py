"""Whether a dotted name the docs or a docstring writes exists in the code (tests/test_docs.py).

``trainer.PserverError``, ``Trainer.step`` (an alias), ``tr.step`` (an instance the examples name),
``TableSet.apply_mean`` (a class of ours, found by name): each resolves by import and getattr, a class's
fields and the attributes its methods set on ``self`` included.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import re
import textwrap
from typing import Optional

from tests.helpers.paths import REPO

PACKAGES = ("trainer", "pserver", "psproto", "transpiler")
# Whose dotted names a page may write and the check resolves: the packages, and what tests and benchmarks
# share (`harness.netns.Hosts`).
NAMED_ROOTS = (*PACKAGES, "harness")
SOURCE_DIRS = {"trainer": "trainer", "pserver": "pserver", "psproto": "proto", "transpiler": "transpiler"}
# Short names the docs use for public classes and modules: `Trainer.step` means trainer.Trainer.step.
ALIASES = {
    "Trainer": "trainer.Trainer",
    "PserverTrainer": "trainer.PserverTrainer",
    "CollectiveTrainer": "trainer.CollectiveTrainer",
    "PserverError": "trainer.PserverError",
    "job_metrics": "trainer.job_metrics",
    "ParameterServer": "pserver.ParameterServer",
    "Program": "transpiler.Program",
    "DistributeTranspiler": "transpiler.DistributeTranspiler",
    "DistributeTranspilerConfig": "transpiler.DistributeTranspilerConfig",
    "TableOptions": "transpiler.TableOptions",
    "TableLifecycle": "transpiler.TableLifecycle",
    "RoleEnv": "transpiler.RoleEnv",
    "Position": "transpiler.Position",
    "PserverProgram": "transpiler.PserverProgram",
    "StartupProgram": "transpiler.StartupProgram",
    "TrainerProgram": "transpiler.TrainerProgram",
    "Security": "psproto.security.Security",
}
# Instances the examples name: `tr.step` is a method of one of the trainers, `env.rank` of RoleEnv.
INSTANCES = {
    "tr": ("trainer.Trainer", "trainer.PserverTrainer", "trainer.CollectiveTrainer"),
    "env": ("transpiler.RoleEnv",),
}
CAMEL_DOTTED = re.compile(r"^[A-Z][a-z]\w*\.[a-z_]\w*")


@functools.cache
def project_classes() -> dict:
    """Class name -> modules that define it, across trainer/, pserver/, proto/ (psproto), transpiler/."""
    found = {}
    for package, folder in SOURCE_DIRS.items():
        for path in (REPO / folder).rglob("*.py"):
            module = ".".join((package, *path.relative_to(REPO / folder).with_suffix("").parts))
            module = module.removesuffix(".__init__")
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef):
                    found.setdefault(node.name, []).append(module)
    return found


@functools.cache
def instance_attributes(cls: type) -> frozenset:
    """The names ``cls`` (or a base of ours) assigns as ``self.<name> = ...`` in its methods."""
    names = set()
    for base in cls.__mro__:
        if base.__module__.split(".")[0] not in PACKAGES:
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(base)))
        for node in ast.walk(tree):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, (ast.AnnAssign, ast.AugAssign))
                else []
            )
            names |= {
                t.attr
                for t in targets
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
            }
    return frozenset(names)


def has_attribute(owner, name: str) -> bool:
    """getattr, or a dataclass field, annotated or instance attribute (no class attribute of their own)."""
    if hasattr(owner, name):
        return True
    if isinstance(owner, type):
        if dataclasses.is_dataclass(owner) and name in {f.name for f in dataclasses.fields(owner)}:
            return True
        if any(name in getattr(base, "__annotations__", {}) for base in owner.__mro__):
            return True
        return name in instance_attributes(owner)
    return False


def resolve(dotted: str) -> Optional[str]:
    """None when ``dotted`` (a module path, then attributes) exists; else what is missing."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for i, name in enumerate(parts[cut:], cut):
            if not has_attribute(owner, name):
                return f"{'.'.join(parts[:i])} has no {name!r}"
            if not hasattr(owner, name):  # a field without a class-level value: its type is not followed
                return None
            owner = getattr(owner, name)
        return None
    return f"no module {parts[0]!r}"


def name_problem(dotted: str) -> Optional[str]:
    """What is wrong with a dotted name a page writes in backticks, or None (also for names not ours)."""
    head, _, rest = dotted.partition(".")
    if head in NAMED_ROOTS:
        return resolve(dotted)
    if head in ALIASES:
        return resolve(f"{ALIASES[head]}.{rest}")
    if head in INSTANCES:
        problems = [resolve(f"{cls}.{rest}") for cls in INSTANCES[head]]
        return None if None in problems else problems[0]
    if CAMEL_DOTTED.match(dotted):  # Class.method: the class must be one of ours and have it
        modules = project_classes().get(head)
        if not modules:
            return f"no class {head!r} in trainer, pserver, psproto or transpiler"
        problems = [resolve(f"{module}.{dotted}") for module in modules]
        return None if None in problems else problems[0]
    return None
