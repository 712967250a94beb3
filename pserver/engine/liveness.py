"""Liveness: the trainers a pserver counts on, and who hears when that set changes.

The *live* trainers are those a sync barrier waits for: every id that has neither closed nor been
dropped. A trainer joins with its Hello, closes when done, is dropped from the barrier when silent past
heartbeat_timeout, and counts as closed once dropped past trainer_rejoin_timeout without coming back, so a
job whose trainer died ends. Silence has one rule for the heartbeat watchdog (:meth:`Liveness.drop_silent`)
and for a second process saying Hello with a trainer's id (:meth:`Liveness.presence`): a trainer is heard
from at its last call, or now while this pserver holds a call of its, parked in one of the engine's waits
or held elsewhere (a Reduce round, a claim, a call being served): :func:`~.roster.heard_at`.

A part of :class:`~.engine.Engine`, built by it over its lock, roster, roll-backs (which record the closed
trainers beside the checkpoints) and waits. A change is told under the lock to the engine's listeners
(``on_roster``) and to the engine itself (``on_close``: the sync step in progress may be complete without
the trainers that left), and after the lock to ``on_roster_change`` (the Reduce service, which asks
:meth:`Liveness.live` under a lock of its own).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import AbstractSet, Callable, List, Optional, Sequence, Set, Tuple

from .listeners import UpdateListener
from .rollback import RollBacks
from .roster import Roster
from .waits import Waits

# Under the engine's name: these are its records, and operators filter its log by that name.
log = logging.getLogger("pserver.engine.engine")


class Liveness:
    """Who is live at the pserver at ``endpoint``, whose step (``applied()``) its records name.

    ``held_elsewhere()``: the trainers with a call held outside the engine, asked before its lock is taken.
    ``all_closed`` is set once every trainer has closed (the job is over), cleared when one rejoins.
    """

    def __init__(
        self,
        cv: threading.Condition,
        roster: Roster,
        rollbacks: RollBacks,
        waits: Waits,
        endpoint: str,
        *,
        applied: Callable[[], int],
        on_close: Callable[[], None],
        listeners: Sequence[UpdateListener] = (),
        on_roster_change: Optional[Callable[[], None]] = None,
        held_elsewhere: Callable[[], AbstractSet[int]] = frozenset,
    ):
        self.cv = cv
        self.roster = roster
        self.rollbacks = rollbacks
        self.waits = waits
        self.endpoint = endpoint
        self.listeners = tuple(listeners)
        self._applied, self._on_close = applied, on_close
        self._on_roster_change, self._held_elsewhere = on_roster_change, held_elsewhere
        self.all_closed = threading.Event()

    # -- who is live and heard from ------------------------------------------------------

    def live(self) -> set:
        """Trainers expected to push (a new set); takes the lock (re-entrant)."""
        with self.cv:
            return self.roster.live()

    def check_live(self, trainer_id: int) -> None:
        """Refuse a trainer that has closed (NotAllowed) or was dropped (MustResync); takes the lock."""
        with self.cv:
            self.roster.check_pusher(trainer_id, self.endpoint, self._applied())

    def held(self) -> Set[int]:
        """Trainers whose calls this pserver holds now, so alive: parked here or elsewhere (a Reduce
        round)."""
        elsewhere = set(self._held_elsewhere())  # first: the Reduce service's lock is never taken inside ours
        with self.cv:
            return self.waits.parked_trainers() | elsewhere

    def presence(self, trainer_id: int) -> Tuple[Optional[float], bool]:
        """(when last heard from, monotonic or None, :meth:`held` ones now; closed or dropped)."""
        held = self.held()
        with self.cv:
            return self.roster.presence(trainer_id, held, time.monotonic())

    def by_state(self) -> Tuple[Set[int], Set[int], Set[int]]:
        """Under the lock: the trainers (alive: joined and live; dropped; closed), copied."""
        roster = self.roster
        return roster.joined & roster.live(), set(roster.dropped), set(roster.closed)

    # -- changes ---------------------------------------------------------------------------

    def join(self, trainer_id: int) -> str:
        """Under the lock: a Hello from ``trainer_id`` (the roll-backs it saw noted); how it joined: "joined",
        "rejoined" or "" (already in)."""
        was_closed = trainer_id in self.roster.closed
        how = self.roster.join(trainer_id)
        self.rollbacks.hello(trainer_id)
        if how == "rejoined":
            self.all_closed.clear()
        if was_closed:
            self.rollbacks.note_closed(self.roster.closed)
            self._noted()
        return how

    def close(self, trainer_id: int) -> int:
        """Mark ``trainer_id`` done; barriers stop waiting for it. Returns trainers left."""
        with self.cv:
            closing = trainer_id not in self.roster.closed
            if closing:
                log.info("%s: trainer %d closed at step %d", self.endpoint, trainer_id, self._applied())
                self._close(trainer_id)
            left = self.trainers_left()
        if closing:
            self.changed()
        return left

    def _close(self, trainer_id: int) -> None:
        self.roster.close(trainer_id)
        self.rollbacks.note_closed(self.roster.closed)
        self._on_close()
        self._noted()

    def trainers_left(self) -> int:
        """Under the lock: how many trainers have not closed (none: :attr:`all_closed` is set); wakes the
        waits."""
        left = len(set(range(self.roster.trainers)) - self.roster.closed)
        if left == 0:
            self.all_closed.set()
        self.waits.notify()
        return left

    def drop_silent(self, timeout: float, rejoin_timeout: Optional[float] = None) -> List[int]:
        """Drop trainers silent for ``timeout`` s: not heard from (:func:`~.roster.heard_at`), nor
        :meth:`held`.

        One dropped ``rejoin_timeout`` s ago and not back counts as closed, so a job whose trainer died
        ends.
        """
        held = self.held()
        with self.cv:
            now = time.monotonic()
            silent = self.roster.drop_silent(timeout, held, now)
            for t, quiet in silent:
                log.warning(
                    "%s: trainer %d sent nothing for %.1fs (heartbeat_timeout %gs); dropped from the barrier "
                    "at step %d; it rejoins by starting again",
                    self.endpoint,
                    t,
                    quiet,
                    timeout,
                    self._applied(),
                )
            if silent:
                self._on_close()
                self.waits.notify()
            gone = self.roster.abandoned(rejoin_timeout, now) if rejoin_timeout is not None else []
            for t, since in gone:
                log.warning(
                    "%s: trainer %d was dropped %.1fs ago and has not rejoined (trainer_rejoin_timeout %gs); "
                    "counted as closed at step %d",
                    self.endpoint,
                    t,
                    since,
                    rejoin_timeout,
                    self._applied(),
                )
                self._close(t)
            if gone:
                self.trainers_left()
        if silent or gone:
            self.changed()
        return [t for t, _ in silent]

    def expect_pushers(self) -> None:
        """Under the lock: every live trainer that pushed counts as just heard from (a backup takes the
        lead).

        Only those that pushed: a trainer yet to say its first Hello is not waited for by the heartbeat
        watchdog, as on any pserver (a fresh shard's first primary has none).
        """
        self.roster.heard_from(self.roster.live() & set(self.roster.last_step), time.monotonic())
        self.waits.notify()

    # -- telling the listeners (under the lock) and the Reduce service (after it) -----------

    def _noted(self) -> None:
        """Under the lock: the roster changed without an update (a trainer closed or came back)."""
        for listener in self.listeners:
            listener.on_roster(self._applied(), self.roster)

    def changed(self) -> None:
        """The live set may have changed. Never under the lock: the Reduce service takes its own lock, and
        under it calls :meth:`live`, which takes this one (see :class:`~.services.reductions.Reductions`)."""
        if self._on_roster_change is not None:
            self._on_roster_change()
