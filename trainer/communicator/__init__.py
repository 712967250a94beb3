"""A trainer's calls to the pservers: the only part of the trainer that speaks gRPC and reads status codes.

``calls.py``: channels, push / pull / prefetch and the unary calls; ``sessions.py``:
Hello (to each shard's primary, with hot standby) and Close; ``status.py``: the
one mapping of status codes to :mod:`trainer.errors`' kinds.
"""
from ..errors import PserverError
from .calls import Communicator, results_of
from .status import kind_of

__all__ = ["Communicator", "PserverError", "kind_of", "results_of"]
