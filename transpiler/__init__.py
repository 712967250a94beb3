"""Transpiler: split a single-machine PyTorch program into pserver and trainer plans.

Public surface::

    from transpiler import Program, DistributeTranspiler, DistributeTranspilerConfig
    from transpiler import TableOptions          # per-table optimizer / initial rows
    from transpiler import RoleEnv               # this process's role, from the environment
    from transpiler import PserverProgram, StartupProgram, TrainerProgram   # the plans

Internals (slicing, hashing, table specs, optimizer specs) are imported from
their modules by the pserver and trainer packages. The names are imported on
first use, so what needs only the environment (``transpiler.env``, ``ps-launch``)
starts without importing torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Public name: the module that defines it.
_EXPORTS = {
    "Program": ".program", "DistributeTranspiler": ".transpiler", "DistributeTranspilerConfig": ".config",
    "TableOptions": ".tables", "RoleEnv": ".env", "PserverProgram": ".plans", "StartupProgram": ".plans",
    "TrainerProgram": ".plans",
}
__all__ = [
    "Program", "DistributeTranspiler", "DistributeTranspilerConfig", "TableOptions", "RoleEnv",
    "PserverProgram", "StartupProgram", "TrainerProgram",
]

if TYPE_CHECKING:
    from .config import DistributeTranspilerConfig
    from .env import RoleEnv
    from .plans import PserverProgram, StartupProgram, TrainerProgram
    from .program import Program
    from .tables import TableOptions
    from .transpiler import DistributeTranspiler


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
