"""What the command-line tools share: a program loaded from ``FILE.py:FUNC``, and the config's flags.

Command-line tools (``python -m transpiler show``, ``ps-server``) take the user's program as a
``FILE.py:FUNC`` or ``package.module:FUNC`` reference (FUNC is called with no arguments and must
return a :class:`Program`), and every :class:`DistributeTranspilerConfig` field as a flag.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import os
import sys

from .config import NONFINITE_GRADS, SPLIT_METHODS, DistributeTranspilerConfig
from .program import Program


def load_program(ref: str) -> Program:
    """Import ``ref`` (``path/to/file.py:func`` or ``pkg.mod:func``) and return ``func()``."""
    target, sep, func_name = ref.rpartition(":")
    if not sep or not target or not func_name:
        raise ValueError(f"program reference {ref!r} must look like FILE.py:FUNC or module:FUNC")
    if target.endswith(".py"):
        if not os.path.isfile(target):
            raise ValueError(f"program file {target!r} does not exist")
        name = "_ps_program_" + os.path.splitext(os.path.basename(target))[0]
        spec = importlib.util.spec_from_file_location(name, target)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ValueError(f"{target} has no callable {func_name!r}")
    program = func()
    if not isinstance(program, Program):
        raise TypeError(f"{ref} returned {type(program).__name__}, not a transpiler.Program")
    return program


CHOICES = {"split_method": SPLIT_METHODS, "nonfinite_grads": NONFINITE_GRADS}
# Fields that are None or an int: their flags parse ints.
INT_OR_NONE = ("max_staleness", "metrics_port", "health_port", "server_replicas", "replica_lease_ttl")


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def add_transpile_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--sync_mode`` and one flag per DistributeTranspilerConfig field."""
    parser.add_argument("--sync_mode", type=_bool, default=True, metavar="BOOL",
                        help="true: synchronous updates (default); false: asynchronous")
    defaults = DistributeTranspilerConfig()
    for f in dataclasses.fields(DistributeTranspilerConfig):
        default = getattr(defaults, f.name)
        if isinstance(default, bool):
            kind = _bool
        elif f.name in INT_OR_NONE:
            kind = int
        elif default is None:
            kind = str
        else:
            kind = type(default)
        parser.add_argument(f"--{f.name}", type=kind, default=default,
                            choices=CHOICES.get(f.name),
                            help=f"DistributeTranspilerConfig.{f.name} (default {default!r})")


def config_from_args(args: argparse.Namespace) -> DistributeTranspilerConfig:
    """Build the config from flags added by :func:`add_transpile_arguments`."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(DistributeTranspilerConfig)}
    return DistributeTranspilerConfig(**values)
