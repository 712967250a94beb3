"""Waits: how an engine's calls wait for a state, parked without a thread, and what ends a wait besides it.

A sync trainer's pull waits for its step's barrier, an async push past
``max_staleness`` for the slowest trainer. Every wait has a deadline
(``barrier_timeout``: :class:`~pserver.errors.BarrierTimeout` naming who is
missing), ends at once when the pserver shuts down
(:class:`~pserver.errors.ShuttingDown`), and ends with
:class:`~pserver.errors.MustResync` when a roll-back abandoned the steps it
waited in (:class:`~pserver.engine.rollback.RollBacks` counts them).

A wait is a :class:`Parked` handle, registered under the engine's lock with
:meth:`Waits.park`; it holds no thread. Whoever changes the state the waits
look at calls :meth:`Waits.notify` under the lock (the thread that applied a
step, say): every parked handle whose condition now holds completes there,
and its callbacks run (the RPC layer's wakes its event loop). The deadline is
the waiter's to enforce: once it has passed, :meth:`Waits.expire` fails the
handle, naming who is missing; a waiter that gives up (its client cancelled)
calls :meth:`Waits.cancel`. :meth:`Waits.wait` is the blocking form over the
same handles, for in-process callers: one set of rules.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterable, List, Optional, Set

from ..errors import BarrierTimeout, MustResync, Refusal, ShuttingDown
from .rollback import RollBacks


class Parked:
    """One parked wait: completes once its condition holds, or fails with the error that ended it.

    ``callbacks`` are called once, with the handle, when it completes or
    fails, by the thread that resolved it and under the engine's lock: they
    must be quick (set an event, schedule a wake-up). ``measured``: the wait
    counts in the barrier histogram (a sync step's). ``trainer``: whose call
    waits (None: no trainer's), a sign of life while the wait lasts.
    """

    __slots__ = (
        "waits",
        "ready",
        "what",
        "missing",
        "deadline",
        "rollbacks",
        "parked_at",
        "done_at",
        "error",
        "measured",
        "trainer",
        "_callbacks",
    )

    def __init__(
        self,
        waits: "Waits",
        ready: Callable[[], bool],
        what: str,
        missing: Callable[[], Iterable[int]],
        deadline: float,
        rollbacks: int,
        measured: bool = False,
        trainer: Optional[int] = None,
    ):
        self.waits = waits
        self.ready = ready
        self.what = what
        self.missing = missing
        self.deadline = deadline
        self.rollbacks = rollbacks
        self.parked_at = time.monotonic()
        self.done_at: Optional[float] = None
        self.error: Optional[Refusal] = None
        self.measured = measured
        self.trainer = trainer
        self._callbacks: List[Callable[["Parked"], None]] = []

    @property
    def done(self) -> bool:
        """Whether the wait has ended (its condition held, or an error ended it)."""
        return self.done_at is not None

    def add_callback(self, callback: Callable[["Parked"], None]) -> None:
        """Call ``callback(self)`` once the wait ends; at once if it has. Call under the engine's lock."""
        if self.done:
            callback(self)
        else:
            self._callbacks.append(callback)

    # -- for waiters outside the lock (the RPC layer's event loop and pool) ----------------

    def on_done(self, callback: Callable[["Parked"], None]) -> None:
        """Takes the lock: :meth:`add_callback`."""
        with self.waits.cv:
            self.add_callback(callback)

    def expire(self) -> None:
        """Takes the lock: :meth:`Waits.expire` (the waiter's deadline passed)."""
        with self.waits.cv:
            self.waits.expire(self)

    def cancel(self) -> None:
        """Takes the lock: :meth:`Waits.cancel` (the waiter gave up; nothing keeps the handle)."""
        with self.waits.cv:
            self.waits.cancel(self)

    def finish(self) -> None:
        """Without the lock, once done: :meth:`Waits.finish` (the histogram, then the error if any)."""
        self.waits.finish(self)

    def result(self) -> None:
        """Raise the error that ended the wait, if any (call once it is done)."""
        if self.error is not None:
            raise self.error

    def _end(self, error: Optional[Refusal]) -> None:
        self.error = error
        self.done_at = time.monotonic()
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)


class Waits:
    """The engine's parked waits on its condition variable ``cv``, each within ``barrier_timeout`` seconds.

    Every method but :meth:`finish` is called under the lock of ``cv``.
    ``rollbacks`` (None: waits no roll-back ends, as the Reduce service's)
    ``on_wait`` gets the seconds a measured wait took, outside the lock.
    ``released`` hears of each trainer whose wait completed: the pserver held
    its call until now, so that is when the trainer was last heard from.
    """

    def __init__(
        self,
        cv: threading.Condition,
        endpoint: str,
        barrier_timeout: float,
        rollbacks: Optional[RollBacks] = None,
        on_wait: Optional[Callable[[float], None]] = None,
        released: Optional[Callable[[int], object]] = None,
    ):
        self.cv = cv
        self.endpoint = endpoint
        self.barrier_timeout = barrier_timeout
        self.rollbacks = rollbacks
        self.on_wait = on_wait
        self.released = released
        self._stopping = False
        self._parked: List[Parked] = []

    @property
    def parked(self) -> int:
        """How many waits are parked now."""
        return len(self._parked)

    def parked_trainers(self) -> Set[int]:
        """The trainers whose calls wait here now: the pserver holds them, so they are not silent."""
        return {h.trainer for h in self._parked if h.trainer is not None}

    def stop(self) -> None:
        """Every wait ends with ShuttingDown, now and later."""
        self._stopping = True
        self.notify()

    def park(
        self,
        ready: Callable[[], bool],
        what: str,
        missing: Callable[[], Iterable[int]],
        measured: bool = False,
        trainer: Optional[int] = None,
    ) -> Parked:
        """A handle that completes once ``ready()`` holds (maybe done already), or fails naming
        ``missing()``."""
        handle = Parked(
            self,
            ready,
            what,
            missing,
            time.monotonic() + self.barrier_timeout,
            self._rollbacks_made(),
            measured,
            trainer,
        )
        if self._settle(handle):
            handle.measured = False  # it never waited
        else:
            self._parked.append(handle)
        return handle

    def notify(self) -> None:
        """The state changed: wake blocking waiters, and end every parked wait that is over now."""
        self.cv.notify_all()
        if self._parked:
            self._parked = [h for h in self._parked if not self._settle(h)]

    def expire(self, handle: Parked) -> None:
        """The waiter's deadline passed: unless its condition holds now, ``handle`` fails with
        BarrierTimeout."""
        if handle.done:
            return
        self._forget(handle)
        if not self._settle(handle):
            handle._end(
                BarrierTimeout(
                    f"pserver {self.endpoint}: {handle.what} still waits for trainers "
                    f"{handle.missing()} after {self.barrier_timeout:g}s"
                )
            )

    def cancel(self, handle: Parked) -> None:
        """The waiter gave up (its client cancelled): ``handle`` is forgotten, and ends unless it has."""
        if not handle.done:
            self._forget(handle)
            handle._end(Refusal(f"pserver {self.endpoint}: the caller of {handle.what} went away"))

    def wait(
        self,
        ready: Callable[[], bool],
        what: str,
        missing: Callable[[], Iterable[int]],
        measured: bool = False,
    ) -> Parked:
        """Block under the lock (released while waiting) until ``ready()``, or raise what ended the wait."""
        handle = self.park(ready, what, missing, measured)
        self.block(handle)
        handle.result()
        return handle

    def block(self, handle: Parked) -> None:
        """Under the lock: wait until ``handle`` is done, expiring it at its deadline."""
        while not handle.done:
            remaining = handle.deadline - time.monotonic()
            if remaining <= 0:
                self.expire(handle)
                break
            self.cv.wait(remaining)

    def finish(self, handle: Optional[Parked]) -> None:
        """Outside the lock, once ``handle`` is done: report a measured wait to ``on_wait``, raise its
        error."""
        if handle is None:
            return
        if handle.measured and self.on_wait is not None:
            self.on_wait(handle.done_at - handle.parked_at)
        handle.result()

    def _settle(self, handle: Parked) -> bool:
        """End ``handle`` if its wait is over (the rules, in today's order); whether it ended."""
        if handle.ready():
            if handle.trainer is not None and self.released is not None:
                self.released(handle.trainer)
            handle._end(None)
        elif self._stopping:
            handle._end(ShuttingDown(f"pserver {self.endpoint} is shutting down"))
        elif self._rollbacks_made() != handle.rollbacks:
            handle._end(
                MustResync(
                    f"pserver {self.endpoint}: rolled back to the checkpoint at step "
                    f"{self.rollbacks.restored_from} while {handle.what} waited; call Hello "
                    f"to re-sync"
                )
            )
        else:
            return False
        return True

    def _rollbacks_made(self) -> int:
        return self.rollbacks.made if self.rollbacks is not None else 0

    def _forget(self, handle: Parked) -> None:
        try:
            self._parked.remove(handle)
        except ValueError:
            pass
