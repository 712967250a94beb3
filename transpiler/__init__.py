"""Transpiler: split a single-machine PyTorch program into pserver and trainer plans.

Public surface::

    from transpiler import Program, DistributeTranspiler, DistributeTranspilerConfig
    from transpiler import TableOptions          # per-table optimizer / initial rows
    from transpiler import RoleEnv               # this process's role, from the environment
    from transpiler import PserverProgram, StartupProgram, TrainerProgram   # the plans

Internals (slicing, hashing, table specs, optimizer specs) are imported from
their modules by the pserver and trainer packages.
"""
from .config import DistributeTranspilerConfig
from .env import RoleEnv
from .plans import PserverProgram, StartupProgram, TrainerProgram
from .program import Program
from .tables import TableOptions
from .transpiler import DistributeTranspiler

__all__ = [
    "Program", "DistributeTranspiler", "DistributeTranspilerConfig", "TableOptions", "RoleEnv",
    "PserverProgram", "StartupProgram", "TrainerProgram",
]
