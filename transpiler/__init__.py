"""Transpiler: split a single-machine PyTorch program into pserver and trainer plans.

Public surface::

    from transpiler import Program, DistributeTranspiler, DistributeTranspilerConfig
    from transpiler import TableOptions          # per-table optimizer / initial rows
"""
from .config import DistributeTranspilerConfig
from .env import RoleEnv
from .hashing import stable_hash_ids, stable_hash_name
from .loader import load_program
from .plans import BlockSpec, ParamSpec, PserverProgram, StartupProgram, TrainerProgram
from .optim import LrSchedule, OptimizerSpec
from .program import Program
from .tables import TableOptimizerSpec, TableOptions, TableSpec, initial_rows, merge_duplicates, shard_of
from .transpiler import DistributeTranspiler, parse_endpoints

__all__ = [
    "Program", "DistributeTranspiler", "DistributeTranspilerConfig", "RoleEnv",
    "OptimizerSpec", "LrSchedule", "BlockSpec", "ParamSpec", "PserverProgram",
    "StartupProgram", "TrainerProgram", "stable_hash_name", "stable_hash_ids",
    "parse_endpoints", "load_program", "TableOptions", "TableSpec", "TableOptimizerSpec",
    "initial_rows", "merge_duplicates", "shard_of",
]
