"""Mode: what a training mode decides about a push, as the handler the engine calls for every one.

ps-lite's request handle: the engine (:class:`~pserver.engine.engine.Engine`) keeps what every mode
shares (the lock, the roster, liveness, waits, listeners, roll-backs, stats) and hands each push,
under its lock, to its mode's :class:`Mode`, built once from the plan (:func:`pserver.engine.modes.for_plan`).
The handler decides whether the push counts (:class:`Arrival`), when it is applied (at the barrier, on
arrival, after a staleness wait), what it is applied as (an optimizer step, or GEO's scaled deltas), the
step its answer waits for and whether reads need a copy; the RPC layer hands it the push's header fields
and keeps no condition of its own.
"""

from __future__ import annotations

import enum
import threading
from abc import ABC, abstractmethod
from typing import Mapping, Optional, Protocol, Sequence, Tuple, Union

import torch

from ...errors import BadRequest
from ...store import BlockStore
from ...tables import SparseGrad, TableSet
from ..pending import PendingStep
from ..rollback import RollBacks
from ..roster import Position, Roster
from ..waits import Parked, Waits

# What a push names of backup trainers' steps (its step's trainers, or dropped from it) is a sync step's.
BACKUP_FIELDS = (
    "a push with step_trainers or dropped is a sync step's, and a dropped one carries no gradients "
    "(backup_trainers)"
)


class Arrival(enum.Enum):
    """A push's ``step`` against the pserver's: what the push is (a decision, before anything changes)."""

    NEW = "new"  # the trainer's first push of the step it may push: it counts
    DUPLICATE = "duplicate"  # a retry of a push counted or applied already: acknowledged, not counted again
    STALE = "stale"  # a step the pserver is past, never counted for this trainer: refused
    AHEAD = "ahead"  # a step the pserver has not reached: refused (a re-sync or roll-back's business)


# The members as module names: a push decides with these (an Enum's attribute lookup costs ~0.2 us).
NEW, DUPLICATE, STALE, AHEAD = Arrival.NEW, Arrival.DUPLICATE, Arrival.STALE, Arrival.AHEAD


class EngineParts(Protocol):
    """What a handler reads and calls of the engine that built it (its parts, under the engine's lock)."""

    step: int
    store: BlockStore
    tables: TableSet
    trainers: int
    endpoint: str
    cv: threading.Condition
    roster: Roster
    waits: Waits
    rollbacks: RollBacks

    def live(self) -> set: ...

    def advance(
        self, lr_step: int, dense: Mapping[str, torch.Tensor], sparse: Mapping[str, SparseGrad]
    ) -> None: ...


class Mode(ABC):
    """One mode's decisions about pushes; the base is what asynchronous modes share.

    Built by the engine's constructor (``engine``: the engine being built; its store, tables and roster
    exist, the rest is read when a method is called). Every method but :meth:`check_push`,
    :meth:`answer_step` and :meth:`park_for_step` runs under the engine's lock. ``pending``: the sync
    step in progress (None: no barrier), which the engine's roll-backs clear too.
    """

    sync = False  # the engine's sync_mode: what Hello and Stats report, and Restore checks
    reads_need_copy = True  # whether a read may overlap an update, so must copy the blocks

    def __init__(self, engine: EngineParts):
        self.engine = engine
        self.pending: Optional[PendingStep] = None

    def check_push(self, step_trainers: Sequence[int], dropped: bool, grads, sparse) -> None:
        """Refuse (:class:`~pserver.errors.BadRequest`) what this mode cannot take of a push, before
        anything counts; called without the lock. Only a sync step's push names its trainers or is
        dropped (backup trainers)."""
        if step_trainers or dropped:
            raise BadRequest(BACKUP_FIELDS)

    @abstractmethod
    def push(
        self,
        trainer_id: int,
        step: int,
        grads: Mapping[str, torch.Tensor],
        sparse: Optional[Mapping[str, SparseGrad]],
        position: Position,
        park: bool,
        step_trainers: Sequence[int],
        dropped: bool,
    ) -> Union[Tuple[bool, int], Parked]:
        """Count or apply the push of a live pusher; (counted, the pserver's step), or with ``park`` the
        handle of a wait it must make first, having done nothing (see
        :meth:`pserver.engine.engine.Engine.push`)."""

    def answer_step(self, step: int) -> int:
        """The update a push of ``step``'s answer waits for (0: none, whatever is there)."""
        return 0

    def park_for_step(self, trainer_id: int, min_step: int) -> Optional[Parked]:
        """A wait (:mod:`pserver.engine.waits`) for ``min_step`` updates; None: none (here: never). Called
        without the lock: a handler that waits takes it."""
        return None

    def start_step(self, trainer_id: int, how: str, join_at: int) -> int:
        """The step a trainer that says Hello (``how``: joined, rejoined or "") starts at: its own next."""
        return self.engine.roster.last_step.get(trainer_id, -1) + 1

    def others_in_step(self, trainer_id: int) -> int:
        """Other trainers whose push of the step in progress is counted or awaited (none: no barrier)."""
        return 0

    def counted_in_step(self) -> bool:
        """Whether some push of the step in progress is counted (none: no step in progress)."""
        return False

    def on_close(self) -> None:
        """A trainer closed or was dropped (a barrier may be complete now)."""

    def apply(
        self, dense: Mapping[str, torch.Tensor], sparse: Mapping[str, SparseGrad], lr_step: int
    ) -> None:
        """Apply an update to the blocks and tables: the optimizer's step with the lr of ``lr_step``.

        Also a backup's apply of its primary's update (hot standby), so both apply it alike.
        """
        self.engine.store.apply(dense, lr_step)
        self.engine.tables.apply(sparse, lr_step)
