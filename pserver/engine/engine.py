"""Engine: the contract the RPC layer talks to, over what every mode shares, and its mode's push handler.

What a push does is its mode's to decide (:mod:`.modes`, ps-lite's request handle): the sync handler
applies step *s* once every live trainer's gradient for *s* has arrived (their mean), the async one
each on arrival, GEO's each as scaled deltas. The engine builds its handler once, from the factory
handed to its constructor (:func:`pserver.engine.modes.for_plan`; :class:`SyncEngine` and
:class:`AsyncEngine` pick one by name), and calls it for every push, Hello and wait.

The other parts handed to its constructor: the blocks and table shards it updates, the
``checkpointer`` its resumes and roll-backs load from, the listeners told of every change
(:mod:`.listeners`). It builds its own state: the roster (:mod:`.roster`), its checkpoints and the
roll-backs made (:mod:`.rollback`), its waits (:mod:`.waits`), and the trainers it counts on as they
join, close, fall silent or never come back (:mod:`.liveness`). All state lives behind one condition
variable; updates and the listeners run under it, transfers do not. A retried push for an already
counted (trainer, step) is a no-op. Refusals are :mod:`pserver.errors`.
"""

from __future__ import annotations

import logging
import threading
from functools import partial
from typing import AbstractSet, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union

import numpy as np
import torch

from ..checkpoint import Checkpointer
from ..errors import StorageFailed
from ..store import BlockStore
from ..tables import SparseGrad, TableSet
from .listeners import Gate, UpdateListener
from .liveness import Liveness
from .modes import AsyncMode, Mode, SyncMode
from .rollback import RollBack, RollBacks
from .roster import Joined, Position, Roster
from .stats import PserverStats
from .waits import Parked, Waits

log = logging.getLogger(__name__)


class Engine:
    """The contract the RPC layer talks to, over what every mode shares: the trainers it counts on
    (:class:`~.liveness.Liveness`), its checkpoints and roll-backs (:class:`~.rollback.RollBacks`), its waits.

    ``mode`` builds the handler of the plan's mode from the engine (:func:`pserver.engine.modes.for_plan`).
    ``checkpointer`` (None without a checkpoint_dir) saves and loads this pserver's part on demand.
    ``listeners`` are told of every change under the lock, in order; ``gate`` refuses the calls a change of
    layout stops. ``on_wait`` gets the seconds a call
    waited for a sync step (the barrier histogram) and ``on_roster_change`` is called whenever the trainers
    :meth:`live` gives may have changed (the Reduce service waits on them under a lock of its own), both
    after the lock is released. ``held_elsewhere``: who has a call held elsewhere (:meth:`held`).
    """

    def __init__(
        self,
        store: BlockStore,
        tables: TableSet,
        trainers: int,
        endpoint: str,
        barrier_timeout: float,
        checkpointer: Optional[Checkpointer] = None,
        *,
        mode: Callable[["Engine"], Mode],
        listeners: Sequence[UpdateListener] = (),
        on_wait: Optional[Callable[[float], None]] = None,
        on_roster_change: Optional[Callable[[], None]] = None,
        held_elsewhere: Callable[[], AbstractSet[int]] = frozenset,
        gate: Gate = Gate(),
    ):
        self.store = store
        self.tables = tables
        self.trainers = trainers
        self.endpoint = endpoint
        self.barrier_timeout = barrier_timeout
        self.cv = threading.Condition()
        self.step = 0
        self.roster = Roster(trainers)
        self.listeners = tuple(listeners)
        self.gate = gate  # a change of layout stops the steps after its switch step here
        # What every push does is the mode's to decide; its handler reads the parts below when called.
        self.mode = mode(self)
        self.sync_mode = self.mode.sync
        self.pending = self.mode.pending  # the sync step in progress (None: no barrier)
        self.rollbacks = RollBacks(checkpointer, endpoint, self.roster, self.pending, self.listeners)
        self.waits = Waits(self.cv, endpoint, barrier_timeout, self.rollbacks, on_wait, released=self.touch)
        self.liveness = Liveness(
            self.cv,
            self.roster,
            self.rollbacks,
            self.waits,
            endpoint,
            applied=lambda: self.step,
            on_close=self.mode.on_close,
            listeners=self.listeners,
            on_roster_change=on_roster_change,
            held_elsewhere=held_elsewhere,
        )
        self.all_closed = self.liveness.all_closed

    @property
    def last_step(self) -> Dict[int, int]:
        return self.roster.last_step

    @property
    def checkpointer(self) -> Optional[Checkpointer]:
        """What this pserver's checkpoints are written with and loaded from (None without a
        checkpoint_dir)."""
        return self.rollbacks.checkpointer

    @property
    def restored_from(self) -> int:
        """The checkpoint step this pserver started from or rolled back to (a backup: its primary's), -1 if
        none."""
        return self.rollbacks.restored_from

    def live(self) -> set:
        """Trainers expected to push: all ids that have neither closed nor been dropped (a new set).

        Takes the lock (re-entrant, so the engines' own calls under it are
        fine): the Reduce service asks from its threads, holding its own lock.
        """
        return self.liveness.live()

    def holds_push_of(self, step: int) -> bool:
        """Whether a push of ``step`` counts here: applied, or counted in the step in progress (backup
        trainers' claims forget a step's set only while no pserver's push of it counts on the first
        pserver)."""
        with self.cv:
            return self.step > step or (self.step == step and self.mode.counted_in_step())

    def check_live(self, trainer_id: int) -> None:
        """Refuse a trainer that has closed (NotAllowed) or was dropped (MustResync) until it says Hello
        again.

        What a push checks first; the Reduce service checks it before a trainer's values join a round.
        """
        self.liveness.check_live(trainer_id)

    # -- an update applied (under the lock) -----------------------------------------------

    def advance(
        self, lr_step: int, dense: Mapping[str, torch.Tensor], sparse: Mapping[str, SparseGrad]
    ) -> None:
        """The mode's handler applied an update with the lr of ``lr_step``: the step moves on, the listeners
        hear of it (in order) and the waits it ends are released."""
        self.step += 1
        for listener in self.listeners:
            listener.on_update(lr_step, self.step, self.roster, dense, sparse)
        self.waits.notify()

    # -- trainers ------------------------------------------------------------------------

    def check_hello(self, trainer_id: int) -> None:
        """Refuse a Hello while a change of layout moves this pserver's state (:class:`.listeners.Gate`)."""
        self.gate.check_hello(trainer_id)

    def hello(self, trainer_id: int, join_at: int = 0) -> Joined:
        """Register ``trainer_id`` (again, after a restart); what it learns, as one :class:`Joined` view.

        Sync: the pserver's current step, shared by all trainers (``join_at``
        one step ahead of it: that step, see :meth:`.modes.sync.SyncMode.start_step`). Async: the
        trainer's own next step (0 for a new trainer). The position is the one
        it pushed with its last applied step (or the checkpoint's), (0, 0) if none.
        """
        with self.cv:
            how = self.liveness.join(trainer_id)
            start = self.mode.start_step(trainer_id, how, join_at)
            if how:
                log.info("%s: trainer %d %s at step %d", self.endpoint, trainer_id, how, start)
            # The queries below take the lock again (it is reentrant): one hold, one consistent view.
            joined = Joined(
                start,
                Position(*self.roster.positions.get(trainer_id, (0, 0))),
                *self.step_in_progress(trainer_id),
                self.counted_step(trainer_id),
                self.restored_from,
            )
        if how == "rejoined":
            self.liveness.changed()
        return joined

    def counted_step(self, trainer_id: int) -> int:
        """The last step of ``trainer_id`` this pserver counted (applied or pending), -1 if none."""
        with self.cv:
            return self.last_step.get(trainer_id, -1)

    def push(
        self,
        trainer_id: int,
        step: int,
        grads: Dict[str, torch.Tensor],
        sparse: Optional[Mapping[str, SparseGrad]] = None,
        position: Position = Position(0, 0),
        park: bool = False,
        step_trainers: Sequence[int] = (),
        dropped: bool = False,
    ) -> Union[Tuple[bool, int], Parked]:
        """Count (sync) or apply (async, GEO) one trainer's gradients of ``step``, as the mode's handler
        decides (:meth:`.modes.mode.Mode.push`); returns (counted, the pserver's step).

        A retried push of a step already counted is acknowledged, not applied twice. ``sparse`` is {table:
        (ids, rows)}. A push that must wait (async, past ``max_staleness``) blocks; with ``park`` it
        returns that wait's handle instead, having done nothing. Backup trainers: ``step_trainers``, the
        step's trainers; ``dropped``, a push left out of its step (:mod:`.modes.backup_steps`). What the
        RPC layer checks first and what the answer waits for are the handler's too (:attr:`mode`:
        :meth:`~.modes.mode.Mode.check_push`, :meth:`~.modes.mode.Mode.answer_step`).
        """
        with self.cv:
            self.gate.check_push(trainer_id, step)
            self.roster.check_pusher(trainer_id, self.endpoint, self.step)
            return self.mode.push(trainer_id, step, grads, sparse, position, park, step_trainers, dropped)

    def park_for_step(self, trainer_id: int, min_step: int) -> Optional[Parked]:
        """A wait (:mod:`.waits`) for ``min_step`` updates (sync: the barrier); None: none (async:
        never)."""
        self.gate.check_wait(trainer_id, min_step)
        return self.mode.park_for_step(trainer_id, min_step)

    def wait_for_step(self, trainer_id: int, min_step: int) -> None:
        """Block on :meth:`park_for_step`'s handle (the same rules); the barrier histogram hears of the
        wait."""
        handle = self.park_for_step(trainer_id, min_step)
        if handle is not None:
            with self.cv:
                self.waits.block(handle)
            handle.finish()

    def step_in_progress(self, trainer_id: int) -> Tuple[int, int]:
        """(steps applied, other trainers whose push of the step in progress is counted or awaited).

        Async: (updates, 0). A sync trainer that joins after the step in
        progress while no other trainer is in it learns that the step never
        completes (see :meth:`.modes.sync.SyncMode.others_in_step`).
        """
        with self.cv:
            return self.step, self.mode.others_in_step(trainer_id)

    def held(self) -> Set[int]:
        """Trainers whose calls this pserver holds now, so alive: parked here or elsewhere (a Reduce
        round)."""
        return self.liveness.held()

    def presence(self, trainer_id: int) -> Tuple[Optional[float], bool]:
        """(when last heard from, monotonic or None, :meth:`held` ones now; closed or dropped): a
        takeover's test."""
        return self.liveness.presence(trainer_id)

    def touch(self, trainer_id: int) -> int:
        """A heartbeat (or any call) from ``trainer_id``; returns the pserver's step.

        Without the lock (one dict store and one int read, atomic in CPython):
        heartbeats must land while a long update or checkpoint holds it, or
        the watchdog would drop every trainer right after.
        """
        self.roster.touch(trainer_id)
        return self.step

    def close(self, trainer_id: int) -> int:
        """Mark ``trainer_id`` done; barriers stop waiting for it. Returns trainers left."""
        return self.liveness.close(trainer_id)

    def drop_silent(self, timeout: float, rejoin_timeout: Optional[float] = None) -> List[int]:
        """Drop trainers silent for ``timeout`` s: not heard from (:func:`~.roster.heard_at`), nor
        :meth:`held`. One dropped ``rejoin_timeout`` s ago and not back counts as closed, so a job whose
        trainer died ends."""
        return self.liveness.drop_silent(timeout, rejoin_timeout)

    def stop(self) -> None:
        """Wake every waiter so the server can shut down."""
        with self.cv:
            self.waits.stop()

    # -- reads -----------------------------------------------------------------------------

    def stats(self) -> PserverStats:
        """This pserver's state as one value (Stats, /metrics); the lock is held only to copy the roster."""
        with self.cv:
            step, states = self.step, self.liveness.by_state()
        return PserverStats.of(
            step, self.sync_mode, self.trainers, states, self.store, self.tables, self.checkpointer
        )

    def read(self, names: Sequence[str]) -> Tuple[int, List[Tuple[str, torch.Tensor]]]:
        """The pserver's step and the named blocks, safe to stream."""
        with self.cv:
            return self.step, self.store.read(names, copy=self.mode.reads_need_copy)

    def read_flat_into(self, out: np.ndarray) -> int:
        """Copy every block, as the store's one flat buffer (:attr:`pserver.store.BlockStore.flat`), into
        ``out`` (uint8, its bytes: an answer region); the pserver's step they are of. One copy under the lock,
        where :meth:`read` copies block by block (async) and the answer copies them again."""
        with self.cv:
            np.copyto(out, self.store.flat.numpy().view(np.uint8))
            return self.step

    def lookup(self, ids: Mapping[str, np.ndarray]) -> Tuple[int, List[Tuple[str, torch.Tensor]]]:
        """The pserver's step and the rows of ``ids`` ({table: ids}), in request order. Each table shard
        locks itself; in sync mode no update can run meanwhile anyway (the next needs this trainer's push)."""
        with self.cv:
            pserver_step = self.step
        return pserver_step, self.tables.lookup(ids)

    def save_tables(self, directory: str) -> Tuple[int, List[str]]:
        """Write every table shard at a step boundary; returns (updates, shard directories).

        A file system error is :class:`StorageFailed`: the pserver is fine, the directory is not.
        """
        with self.cv:
            try:
                return self.step, self.tables.save(directory)
            except OSError as e:
                raise StorageFailed(
                    f"pserver {self.endpoint}: cannot save tables to {directory!r}: {e}"
                ) from None

    # -- checkpoints, resume and roll-back --------------------------------------------------

    def checkpoint(self) -> Tuple[int, str]:
        """Write a checkpoint of this pserver now, at a step boundary; (its step, part directory).

        Refused (:class:`NotAllowed`) without a checkpoint_dir; a file system
        error is :class:`StorageFailed`.
        """
        with self.cv:
            return self.rollbacks.checkpoint(self.step)

    def resume(self, step: Optional[int] = None) -> bool:
        """Load the latest complete checkpoint (or the one at ``step``); False if there is none."""
        with self.cv:
            loaded = self.rollbacks.resume(step)
            if loaded is not None:
                self.step = loaded
            return loaded is not None

    def restore(self, trainer_id: int, step: int, token: str) -> bool:
        """Roll back to the checkpoint at ``step`` once per ``token`` (sync recovery).

        Returns False when ``token`` was already honoured, or when this pserver stands unchanged at that
        very checkpoint: the pushes it counted since are kept (see :meth:`RollBacks.roll_back`). Otherwise
        the waits of the abandoned steps end with :class:`MustResync`. Without a checkpoint_dir:
        :class:`NotAllowed`; a checkpoint that cannot be loaded changes nothing.
        """
        self.rollbacks.check_can_roll_back()
        with self.cv:
            outcome, loaded = self.rollbacks.roll_back(trainer_id, step, token, self.step)
            if outcome is RollBack.STAYS and self.pending is not None and self.pending.forget_joins():
                # A trainer that was told it starts a step later is now expected in this one: a
                # wait of its from before is on the abandoned timeline, as after a roll-back.
                self.rollbacks.abandon_timeline()
                self.waits.notify()
            if outcome is RollBack.LOADED:
                self.step = loaded
                self.rollbacks.abandon_timeline()
                self.waits.notify()
        if outcome is RollBack.LOADED:
            self.liveness.changed()  # the checkpoint's closed trainers, nobody dropped: after the lock
        return outcome is RollBack.LOADED

    # -- hot standby (docs/recovery.md, "Hot standby") ----------------------------------------------------

    def follow_copy(self, meta: dict, checkpoint_step: int) -> int:
        """Backup: take the step and roster of the primary's state copy just loaded into the blocks and
        tables.

        ``checkpoint_step`` is the primary's history (what Hello reports once this process leads), not this
        process's own start. Returns the pserver's step.
        """
        with self.cv:
            self.step = self.rollbacks.follow(meta, checkpoint_step)
            return self.step

    def apply_replicated(
        self,
        lr_step: int,
        pserver_step: int,
        roster_meta: dict,
        dense: Dict[str, torch.Tensor],
        sparse: Mapping[str, SparseGrad],
    ) -> None:
        """Backup: apply the primary's update (``lr_step`` -1: its roster alone) and take its count and
        roster.

        The dense gradients and the merged table gradients are the ones the primary applied with the
        learning rate of ``lr_step`` (its mean, never computed again here from pushes whose order could
        differ); trainers' progress and who closed come as the primary's roster after it.
        """
        with self.cv:
            if lr_step >= 0:
                self.mode.apply(dense, sparse, lr_step)
            self.step = pserver_step
            self.roster.follow(roster_meta)
            self.liveness.trainers_left()  # every trainer closed on the primary: the job is over here too

    def take_lead(self) -> None:
        """A backup becomes the primary: every live trainer that pushed is expected, as if just heard from.

        Those that do not come within heartbeat_timeout are dropped as on any primary.
        """
        with self.cv:
            self.liveness.expect_pushers()
            self.gate.on_lead()  # a change of layout in progress may need this shard's new primary
        log.info("%s: leads its shard at update %d", self.endpoint, self.step)


class SyncEngine(Engine):
    """An engine of sync mode (:class:`~.modes.sync.SyncMode`, the barrier), built by name."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, mode=SyncMode, **kwargs)


class AsyncEngine(Engine):
    """An engine of async mode (:class:`~.modes.asynchronous.AsyncMode`, on arrival; ``max_staleness``)."""

    def __init__(self, *args, max_staleness: Optional[int] = None, **kwargs):
        super().__init__(*args, mode=partial(AsyncMode, max_staleness=max_staleness), **kwargs)
