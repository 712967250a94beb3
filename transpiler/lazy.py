"""Package surfaces whose names are imported on first use (PEP 562).

A package's ``__init__`` that imported its whole surface would load torch for
anything that touches the package, ``ps-launch`` included, which needs none
of it. Both ``transpiler`` and ``trainer`` publish their names through this.
"""

from __future__ import annotations

import importlib
from typing import Callable, Dict


def lazy_exports(package: str, exports: Dict[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package``: ``exports`` maps each public name to its relative module.

    The first access imports the module and caches the name in the package, so
    later accesses cost nothing; other names raise AttributeError as usual.
    """

    def __getattr__(name: str) -> object:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(importlib.import_module(package), name, value)
        return value

    return __getattr__
