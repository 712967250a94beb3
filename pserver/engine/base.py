"""Update engines: when a pushed gradient is applied, and who waits for whom.

- :class:`~pserver.engine.sync.SyncEngine`: step *s* is applied once every live
  trainer's gradient for *s* has arrived, with the mean over the trainers that pushed it.
- :class:`~pserver.engine.asynchronous.AsyncEngine`: each gradient is applied on arrival;
  with ``max_staleness`` a trainer too far ahead of the slowest one waits.

This module holds what both share (:class:`Engine`).

Both keep trainer bookkeeping (joined, closed, last counted step) and make a
retried push for an already counted (trainer, step) a no-op. A push carries
dense block gradients and sparse table gradients of one step, counted and
applied together. All state lives behind one condition variable; updates run
under it, transfers do not.

A refused request raises a :mod:`pserver.errors` refusal; which wire status it
becomes is the servicer's business, not the engines'. The servicer reaches the
blocks and tables only through this contract: what a push or prefetch may carry
and how a received push splits, in :mod:`.contents`.
"""
from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from typing import Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from ..checkpoint import Checkpointer
from ..errors import BarrierTimeout, MustResync, NotAllowed, Refusal, ShuttingDown, StorageFailed
from ..store import BlockStore
from ..tables import SparseGrad, TableSet
from .contents import Contents
from .replicated import Replicated
from .rollback import Checkpoints
from .roster import Position, Roster
from .snapshot import Snapshot

log = logging.getLogger(__name__)


class Joined(NamedTuple):
    """What a trainer's Hello learns of this pserver, read under one hold of the engine's lock.

    One consistent view: read piecewise, a step completing in between would
    pair a start step with the applied steps of another moment, and a
    joining trainer could take pservers mid-step for stalled ones.
    """

    step: int                 # where the trainer (re)starts (see Engine.hello)
    position: Position        # its data position as last pushed or checkpointed, (0, 0) if none
    applied_step: int         # steps applied (async: updates)
    others_in_step: int       # other trainers counted or awaited in the step in progress (async: 0)
    counted_step: int         # the trainer's last step counted here, -1 if none
    checkpoint_step: int      # the checkpoint this process started from or rolled back to, -1 if none


class Engine(Contents, Checkpoints, Replicated, ABC):
    """The contract the RPC layer talks to, and the trainer bookkeeping, checkpoints and roll-backs both engines share.

    ``checkpointer`` (None without a checkpoint_dir) saves and loads this
    pserver's part. :meth:`push` and :meth:`wait_updates` are where the
    engines differ. ``on_wait`` is called with the seconds a trainer's call
    waited for a sync step (the barrier wait histogram), after the lock is
    released. ``on_roster_change`` is called, after the lock is released,
    whenever the trainers :meth:`live` gives may have changed (a trainer
    closed, was dropped, rejoined, or a roll-back reset them): the Reduce
    service waits on that set under a lock of its own.
    """

    sync_mode = False

    def __init__(self, store: BlockStore, tables: TableSet, trainers: int, endpoint: str,
                 barrier_timeout: float, checkpointer: Optional[Checkpointer] = None, *,
                 on_wait: Optional[Callable[[float], None]] = None,
                 on_roster_change: Optional[Callable[[], None]] = None):
        self.store = store
        self.tables = tables
        self.trainers = trainers
        self.endpoint = endpoint
        self.barrier_timeout = barrier_timeout
        self.cv = threading.Condition()
        self.updates = 0
        self.roster = Roster(trainers)
        self.all_closed = threading.Event()
        self._stopping = False
        self.checkpointer = checkpointer
        # Scheduled table exports for serving (pserver.tables.serving.exporter), set by the server; None: off.
        self.exporter = None
        # Recovery: roll-back tokens honoured, and a count that wakes waiters after one.
        self.restored_from = -1
        self._honoured: set = set()
        self._rollbacks = 0
        # Per trainer, the roll-backs counted at its last Hello: a wait from before the latest one
        # belongs to an abandoned timeline (see waits_from_before_a_roll_back).
        self._hello_rollbacks: Dict[int, int] = {}
        self.on_wait = on_wait
        self.on_roster_change = on_roster_change

    @property
    def last_step(self) -> Dict[int, int]:
        return self.roster.last_step

    def live(self) -> set:
        """Trainers expected to push: all ids that have neither closed nor been dropped (a new set).

        Takes the lock (re-entrant, so the engines' own calls under it are
        fine): the Reduce service asks from its threads, holding its own lock.
        """
        with self.cv:
            return self.roster.live()

    def check_live(self, trainer_id: int) -> None:
        """Refuse a trainer that has closed (NotAllowed) or was dropped (MustResync) until it says Hello again.

        What a push checks first; the Reduce service checks it before a
        trainer's values join a round.
        """
        with self.cv:
            self._check_pusher(trainer_id)

    def _roster_changed(self) -> None:
        # Never under the lock: the listener takes its own lock, and under it calls live(), which
        # takes this one (see pserver.engine.reductions.Reductions).
        if self.on_roster_change is not None:
            self.on_roster_change()

    def hello(self, trainer_id: int, join_at: int = 0) -> Joined:
        """Register ``trainer_id`` (again, after a restart); what it learns, as one :class:`Joined` view.

        Sync: the pserver's current step, shared by all trainers (``join_at``
        one step ahead of it: that step, see :class:`SyncEngine`). Async: the
        trainer's own next step (0 for a new trainer). The position is the one
        it pushed with its last applied step (or the checkpoint's), (0, 0) if none.
        """
        with self.cv:
            was_closed = trainer_id in self.roster.closed
            how = self.roster.join(trainer_id)
            self._hello_rollbacks[trainer_id] = self._rollbacks
            if how == "rejoined":
                self.all_closed.clear()
            if was_closed:
                self._note_closed()
                self._replicate_roster()
            start = self._start_step(trainer_id, how, join_at)
            if how:
                log.info("%s: trainer %d %s at step %d", self.endpoint, trainer_id, how, start)
            # The queries below take the lock again (it is reentrant): one hold, one consistent view.
            joined = Joined(start, Position(*self.roster.positions.get(trainer_id, (0, 0))),
                            *self.step_in_progress(trainer_id), self.counted_step(trainer_id), self.restored_from)
        if how == "rejoined":
            self._roster_changed()
        return joined

    def counted_step(self, trainer_id: int) -> int:
        """The last step of ``trainer_id`` this pserver counted (applied or pending), -1 if none."""
        with self.cv:
            return self.last_step.get(trainer_id, -1)

    @abstractmethod
    def push(self, trainer_id: int, step: int, grads: Dict[str, torch.Tensor],
             sparse: Optional[Mapping[str, SparseGrad]] = None,
             position: Position = Position(0, 0)) -> Tuple[bool, int]:
        """Count (sync) or apply (async) one trainer's gradients of ``step``; returns (counted, updates).

        A retried push of a step already counted is acknowledged, not applied
        twice. ``sparse`` is {table: (ids, rows)}.
        """

    @abstractmethod
    def wait_updates(self, trainer_id: int, min_updates: int) -> None:
        """Block until ``min_updates`` updates are applied (sync: the step's barrier), within its deadline."""

    def step_in_progress(self, trainer_id: int) -> Tuple[int, int]:
        """(steps applied, other trainers whose push of the step in progress is counted or awaited).

        Async: (updates, 0). A sync trainer that joins after the step in
        progress while no other trainer is in it learns that the step never
        completes (see :class:`SyncEngine`).
        """
        with self.cv:
            return self.updates, self._others_in_step(trainer_id)

    def _others_in_step(self, trainer_id: int) -> int:
        return 0

    def _start_step(self, trainer_id: int, how: str, join_at: int) -> int:
        return self.last_step.get(trainer_id, -1) + 1

    def presence(self, trainer_id: int) -> Tuple[Optional[float], bool]:
        """(when ``trainer_id`` last called, monotonic or None; whether it closed or was dropped)."""
        with self.cv:
            roster = self.roster
            return roster.last_seen.get(trainer_id), trainer_id in roster.closed | roster.dropped

    def touch(self, trainer_id: int) -> int:
        """A heartbeat (or any call) from ``trainer_id``; returns the updates applied.

        Without the lock (one dict store and one int read, atomic in CPython):
        heartbeats must land while a long update or checkpoint holds it, or
        the watchdog would drop every trainer right after.
        """
        self.roster.touch(trainer_id)
        return self.updates

    def close(self, trainer_id: int) -> int:
        """Mark ``trainer_id`` done; barriers stop waiting for it. Returns trainers left."""
        with self.cv:
            closing = trainer_id not in self.roster.closed
            if closing:
                log.info("%s: trainer %d closed at step %d", self.endpoint, trainer_id, self.updates)
                self._close(trainer_id)
            left = self._trainers_left()
        if closing:
            self._roster_changed()
        return left

    def _close(self, trainer_id: int) -> None:
        self.roster.close(trainer_id)
        self._note_closed()
        self._on_close()
        self._replicate_roster()

    def _trainers_left(self) -> int:
        left = len(set(range(self.trainers)) - self.roster.closed)
        if left == 0:
            self.all_closed.set()
        self.cv.notify_all()
        return left

    def drop_silent(self, timeout: float, rejoin_timeout: Optional[float] = None) -> List[int]:
        """Drop trainers silent for ``timeout`` s from barriers and staleness bounds; returns them.

        A trainer dropped more than ``rejoin_timeout`` s ago that has not
        rejoined is counted as closed, so a job whose trainer died for good
        still ends once the others close.
        """
        with self.cv:
            now = time.monotonic()
            silent = self.roster.silent(timeout)
            for t, quiet in silent:
                self.roster.drop(t, now)
                log.warning("%s: trainer %d sent nothing for %.1fs (heartbeat_timeout %gs); dropped "
                            "from the barrier at step %d; it rejoins by starting again", self.endpoint,
                            t, quiet, timeout, self.updates)
            if silent:
                self._on_close()
                self.cv.notify_all()
            gone = self.roster.abandoned(rejoin_timeout, now) if rejoin_timeout is not None else []
            for t, since in gone:
                log.warning("%s: trainer %d was dropped %.1fs ago and has not rejoined "
                            "(trainer_rejoin_timeout %gs); counted as closed at step %d", self.endpoint,
                            t, since, rejoin_timeout, self.updates)
                self._close(t)
            if gone:
                self._trainers_left()
        if silent or gone:
            self._roster_changed()
        return [t for t, _ in silent]

    def stop(self) -> None:
        """Wake every waiter so the server can shut down."""
        with self.cv:
            self._stopping = True
            self.cv.notify_all()

    def _check_pusher(self, trainer_id: int) -> None:
        if trainer_id in self.roster.closed:
            raise NotAllowed(f"pserver {self.endpoint}: trainer {trainer_id} has closed; "
                             f"call Hello to rejoin before pushing")
        if trainer_id in self.roster.dropped:
            raise MustResync(f"pserver {self.endpoint}: trainer {trainer_id} was dropped after "
                             f"heartbeat_timeout at step {self.updates}; call Hello to rejoin")

    def _ahead(self, trainer_id: int, what: str, target: int) -> Refusal:
        """The refusal of a push or wait for a step beyond the next one."""
        if self.restored_from >= 0:
            # This pserver restarted or rolled back to a checkpoint: the trainer must re-sync.
            return MustResync(f"pserver {self.endpoint}: trainer {trainer_id} {what} {target}, but this "
                              f"pserver resumed from the checkpoint at step {self.restored_from} and "
                              f"is at step {self.updates}; call Hello to re-sync")
        return NotAllowed(f"pserver {self.endpoint}: trainer {trainer_id} {what} {target} from the "
                          f"future; the pserver is at step {self.updates} and can only reach "
                          f"{self.updates + 1} next")

    def _refuse_wait_from_before_a_roll_back(self, trainer_id: int, what: str) -> None:
        """MustResync for a trainer that said Hello before this pserver's latest roll-back and would wait.

        The caller checked that the step waited for needs this trainer's own
        push: a trainer still on the abandoned timeline would wait for it
        until the barrier deadline. (One whose push for the step was counted
        waits as usual.)
        """
        if self._hello_rollbacks.get(trainer_id, self._rollbacks) != self._rollbacks:
            raise MustResync(f"pserver {self.endpoint}: rolled back to the checkpoint at step "
                             f"{self.restored_from} since trainer {trainer_id} said Hello; its {what} "
                             f"belongs to the steps abandoned; call Hello to re-sync")

    def _wait(self, ready, what: str, missing) -> None:
        """Wait under the lock until ``ready()``, or fail naming who is missing."""
        deadline = time.monotonic() + self.barrier_timeout
        rollbacks = self._rollbacks
        while not ready():
            if self._stopping:
                raise ShuttingDown(f"pserver {self.endpoint} is shutting down")
            if self._rollbacks != rollbacks:
                raise MustResync(f"pserver {self.endpoint}: rolled back to the checkpoint at step "
                                 f"{self.restored_from} while {what} waited; call Hello to re-sync")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BarrierTimeout(f"pserver {self.endpoint}: {what} still waits for trainers "
                                     f"{missing()} after {self.barrier_timeout:g}s")
            self.cv.wait(remaining)

    def snapshot(self) -> Snapshot:
        """This pserver's state as one value (Stats, /metrics); the lock is held only to copy the roster."""
        with self.cv:
            roster = self.roster
            alive, dropped, closed = roster.joined & roster.live(), set(roster.dropped), set(roster.closed)
            step = self.updates
        last = self.checkpointer.last if self.checkpointer is not None else None
        return Snapshot(step, self.sync_mode, self.trainers, tuple(sorted(alive)), tuple(sorted(dropped)),
                        tuple(sorted(closed)), len(self.store.blocks), self.store.nbytes, self.tables.rows,
                        self.tables.nbytes, last, self.tables.stats())

    def read(self, names: Sequence[str]) -> Tuple[int, List[Tuple[str, torch.Tensor]]]:
        """The updates applied and the named blocks, safe to stream."""
        with self.cv:
            return self.updates, self.store.read(names, copy=self._reads_need_copy())

    def lookup(self, ids: Mapping[str, np.ndarray]) -> Tuple[int, List[Tuple[str, torch.Tensor]]]:
        """The updates applied and the rows of ``ids`` ({table: ids}), in request order.

        Each table shard locks itself; in sync mode no update can run
        meanwhile anyway, since the next one needs this trainer's push.
        """
        with self.cv:
            updates = self.updates
        return updates, self.tables.lookup(ids)

    def save_tables(self, directory: str) -> Tuple[int, List[str]]:
        """Write every table shard at a step boundary; returns (updates, shard directories).

        A file system error is :class:`StorageFailed`: the pserver is fine, the directory is not.
        """
        with self.cv:
            try:
                return self.updates, self.tables.save(directory)
            except OSError as e:
                raise StorageFailed(f"pserver {self.endpoint}: cannot save tables to {directory!r}: "
                                    f"{e}") from None

    def _note_closed(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.note_closed(self.roster.closed)

    def _clear_pending(self) -> None:
        pass

    def _forget_join_steps(self) -> bool:
        """A roll-back to the step this pserver stands at: every trainer redoes that step.

        Returns whether a trainer had been told it starts a step later.
        """
        return False

    def _reads_need_copy(self) -> bool:
        return True

    def _on_close(self) -> None:
        pass
