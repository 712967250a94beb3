"""Pserver: owns parameter blocks, applies trainers' gradients, serves over gRPC.

Public surface::

    from pserver import ParameterServer
    ParameterServer(pserver_program, startup_program).serve()
"""
from .server import ParameterServer

__all__ = ["ParameterServer"]
