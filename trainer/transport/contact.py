"""Contact: when a pserver last heard from this trainer, as far as the trainer can tell
(trainer/heartbeat.py).

A pserver notes every call as a sign of life on arrival, and a call it holds (a sync push parked in its
barrier, a pull waiting for its step, a Reduce waiting for its round) is no silence to it: its
``drop_silent`` skips trainers with a parked call and counts the wait's end as heard. So, to the trainer, a
call in flight is contact for as long as it lasts, and a call that answered is contact until its answer: a
push that parks longer than a ``heartbeat_interval`` brings no heartbeat.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator


class Contact:
    """One pserver's contact: the latest call's start or answer, and how many calls are in flight now."""

    def __init__(self):
        self._lock = threading.Lock()
        self._last = float("-inf")
        self._in_flight = 0

    def noted(self, at: float) -> None:
        """A call the pserver noted at ``at`` (monotonic s), already answered."""
        with self._lock:
            self._last = max(self._last, at)

    @contextlib.contextmanager
    def call(self, from_start: bool = True) -> Iterator[None]:
        """Around one call: in flight from its start (``from_start``; else it counts once answered), then
        answered.

        A call that fails counts from its start only: the pserver may never have seen it.
        """
        started = time.monotonic()
        if from_start:
            self.begin()
        answered = False
        try:
            yield
            answered = True
        finally:
            if from_start:
                self.end(answered)
            elif answered:
                self.noted(started)

    def begin(self) -> None:
        """A call starts now: in flight, so contact, until its :meth:`end` (:meth:`call` around a call made
        in one piece)."""
        with self._lock:
            self._in_flight += 1
            self._last = max(self._last, time.monotonic())

    def end(self, answered: bool) -> None:
        """The call :meth:`begin` counted ended; if ``answered``, the pserver heard it up to now."""
        with self._lock:
            self._in_flight -= 1
            if answered:
                self._last = max(self._last, time.monotonic())

    def last(self, now: float) -> float:
        """When the pserver last heard from this trainer: ``now`` while a call is in flight."""
        with self._lock:
            return now if self._in_flight else self._last
