"""Transpiler: split a single-machine PyTorch program into pserver and trainer plans.

Public surface::

    from transpiler import Program, DistributeTranspiler, DistributeTranspilerConfig
    from transpiler import TableOptions          # per-table optimizer / initial rows
    from transpiler import TableLifecycle        # per-table admission, eviction, disk tier
    from transpiler import RoleEnv               # this process's role, from the environment
    from transpiler import PserverProgram, StartupProgram, TrainerProgram   # the plans
    from transpiler import Position              # (epoch, batch): where a trainer's data stands

Internals (placement, table specs, optimizer specs) are imported from
their modules by the pserver and trainer packages. The names are imported on
first use, so what needs only the environment (``transpiler.roles.role_env``, ``ps-launch``)
starts without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy import lazy_exports

__getattr__ = lazy_exports(
    __name__,
    {  # public name: the module that defines it
        "Program": ".program",
        "DistributeTranspiler": ".transpiler",
        "DistributeTranspilerConfig": ".config",
        "TableOptions": ".tables",
        "RoleEnv": ".roles.role_env",
        "PserverProgram": ".plans",
        "StartupProgram": ".plans",
        "TrainerProgram": ".plans",
        "Position": ".position",
        "TableLifecycle": ".lifecycle",
    },
)
__all__ = [
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

if TYPE_CHECKING:
    from .config import DistributeTranspilerConfig
    from .lifecycle import TableLifecycle
    from .plans import PserverProgram, StartupProgram, TrainerProgram
    from .position import Position
    from .program import Program
    from .roles.role_env import RoleEnv
    from .tables import TableOptions
    from .transpiler import DistributeTranspiler
