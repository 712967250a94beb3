"""Waits: how an engine's calls wait under its lock, and what ends a wait besides the awaited state.

A sync trainer's pull waits for its step's barrier, an async push past
``max_staleness`` for the slowest trainer. Every wait has a deadline
(``barrier_timeout``: :class:`~pserver.errors.BarrierTimeout` naming who is
missing), ends at once when the pserver shuts down
(:class:`~pserver.errors.ShuttingDown`), and ends with
:class:`~pserver.errors.MustResync` when a roll-back abandoned the steps it
waited in (:class:`~pserver.engine.rollback.RollBacks` counts them).
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Iterable

from ..errors import BarrierTimeout, MustResync, ShuttingDown
from .rollback import RollBacks


class Waits:
    """The engine's waits on its condition variable ``cv``, each within ``barrier_timeout`` seconds."""

    def __init__(self, cv: threading.Condition, endpoint: str, barrier_timeout: float, rollbacks: RollBacks):
        self.cv = cv
        self.endpoint = endpoint
        self.barrier_timeout = barrier_timeout
        self.rollbacks = rollbacks
        self._stopping = False

    def stop(self) -> None:
        """Under the lock: every wait ends with ShuttingDown, now and later."""
        self._stopping = True
        self.cv.notify_all()

    def wait(self, ready: Callable[[], bool], what: str, missing: Callable[[], Iterable[int]]) -> None:
        """Wait under the lock until ``ready()``, or fail naming who is ``missing()``."""
        deadline = time.monotonic() + self.barrier_timeout
        rollbacks = self.rollbacks.made
        while not ready():
            if self._stopping:
                raise ShuttingDown(f"pserver {self.endpoint} is shutting down")
            if self.rollbacks.made != rollbacks:
                raise MustResync(f"pserver {self.endpoint}: rolled back to the checkpoint at step "
                                 f"{self.rollbacks.restored_from} while {what} waited; call Hello to re-sync")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BarrierTimeout(f"pserver {self.endpoint}: {what} still waits for trainers "
                                     f"{missing()} after {self.barrier_timeout:g}s")
            self.cv.wait(remaining)
