"""Trainer recovery: a pure decision core (:mod:`.decide`) and the thin I/O around it (:mod:`.healer`)."""

from .decide import JOIN, RETRY, ROLLBACK, SKIP, Decision, PserverState
from .healer import Recovery, recoverable

__all__ = ["Recovery", "Decision", "PserverState", "recoverable", "RETRY", "SKIP", "ROLLBACK", "JOIN"]
