"""Pserver: owns parameter blocks, applies trainers' gradients, serves over gRPC.

Public surface::

    from pserver import ParameterServer
    ParameterServer(pserver_program, startup_program).serve()

The name is imported on first use, so a helper of the package (a table's
rows, the checkpoint layout, ps-stat's formatting) loads neither gRPC nor the
server's two dozen modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from transpiler.lazy import lazy_exports

__getattr__ = lazy_exports(
    __name__, {"ParameterServer": ".server"}
)  # public name: the module that defines it
__all__ = ["ParameterServer"]

if TYPE_CHECKING:
    from .server import ParameterServer
