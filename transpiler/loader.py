"""Load a Program from a ``FILE.py:FUNC`` or ``package.module:FUNC`` reference.

Command-line tools (``python -m transpiler show``, ``ps-server``) take the
user's program this way: FUNC is called with no arguments and must return a
:class:`Program`.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys

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
