"""SyncMode: step *s* is applied once every expected trainer's gradient for *s* has arrived (the barrier).

The update uses the mean over the trainers that pushed the step, so N trainers
on batch b equal one process on the concatenated N*b batch. With backup
trainers a step waits for the trainers its pushes name, and a trainer left out
pushes it dropped (:mod:`.backup_steps`).
"""

from __future__ import annotations

import logging
from typing import Mapping, Optional, Sequence, Tuple

import torch

from ...errors import NotAllowed
from ...tables import SparseGrad
from ..pending import PendingStep
from ..roster import Position
from ..waits import Parked
from .backup_steps import check_sync_push, dropped_arrival, made_of_others
from .mode import AHEAD, DUPLICATE, NEW, STALE, Arrival, EngineParts, Mode

# The name its records always had: a filter set on it keeps working.
log = logging.getLogger("pserver.engine.sync")


def counted_arrival(step: int, pserver_step: int, counted: bool, last_counted: int) -> Arrival:
    """What a push of ``step`` is at a pserver at ``pserver_step``: ``counted``, whether the trainer's push
    of the step in progress is counted; ``last_counted``, the trainer's last step counted (-1: none)."""
    if step == pserver_step:
        return DUPLICATE if counted else NEW
    if step < pserver_step:
        return DUPLICATE if last_counted >= step else STALE
    return AHEAD


class SyncMode(Mode):
    """Applies step s once all live trainers pushed it, with their mean gradient.

    Its step in progress is a :class:`~pserver.engine.pending.PendingStep` (``pending``), summed from the
    store's flat layout (:meth:`pserver.store.BlockStore.dense_sums`), which the engine's roll-backs clear
    too.
    """

    sync = True
    # Between two sync steps nothing writes the blocks: the next update
    # needs this very trainer's next push, which follows its pull.
    reads_need_copy = False

    def __init__(self, engine: EngineParts):
        super().__init__(engine)
        self.pending = PendingStep(engine.store.dense_sums())

    def check_push(self, step_trainers: Sequence[int], dropped: bool, grads, sparse) -> None:
        """A push may name its step's trainers or come dropped (backup trainers); a dropped one carries
        nothing."""
        check_sync_push(dropped, grads, sparse)

    def answer_step(self, step: int) -> int:
        """The trainer's next step needs this one applied."""
        return step + 1

    def start_step(self, trainer_id: int, how: str, join_at: int) -> int:
        """The pserver's step, shared by all trainers; a step later for one that rejoined mid-step, or
        found another pserver a step ahead (``join_at``)."""
        engine, pending = self.engine, self.pending
        later = []
        if how == "rejoined" and pending.trainers:
            # The step in progress goes on without it: waiting for a trainer that has
            # to pull first would stall it, and a late gradient would be stale.
            later.append(engine.step + 1)
        if join_at == engine.step + 1:
            # The trainer found another pserver a step ahead and starts there: this one finishes its
            # step without it. Waiting for it would deadlock, as it waits for the pservers to agree
            # (and its repeated Hellos keep it from being dropped). Further ahead is a roll-back's
            # business, not a join's: ignored.
            later.append(join_at)
        if later:
            pending.join_later(trainer_id, max(later))
            # The others' pushes of the step in progress may all be here already: no later push
            # would come to complete it (theirs wait for this very step).
            self.apply_if_complete()
        return max(pending.joins_at_step(trainer_id), engine.step)

    def others_in_step(self, trainer_id: int) -> int:
        """A trainer that joins after the step in progress while no other is in it learns that the step
        never completes."""
        return len((self.pending.trainers | self._expected()) - {trainer_id})

    def counted_in_step(self) -> bool:
        return bool(self.pending.trainers)

    def _expected(self) -> set:
        return self.pending.expected(self.engine.roster.live(), self.engine.step)

    def _abandoned_by_its_set(self, trainer_id: int, step: int) -> bool:
        """Backup trainers: ``trainer_id`` was dropped from ``step`` (in progress), no push of it counts here,
        and no live trainer is expected: its set left before pushing. The dropped trainer's wait ends with
        the step unapplied, telling it to claim the step again (docs/modes.md, backup trainers)."""
        pending = self.pending
        return (
            step == self.engine.step
            and trainer_id in pending.dropped
            and not pending.trainers
            and not self._expected()
        )

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
    ) -> Tuple[bool, int]:
        """Count ``grads`` and ``sparse`` for ``step``; returns (counted, the pserver's step). Applies when
        complete.

        ``grads`` are copied into the step's sums: the caller keeps its buffers. ``sparse`` ({table: (ids,
        rows)}) is kept until the step is applied: the caller must not reuse it. Backup trainers
        (:mod:`.backup_steps`): ``step_trainers`` are the step's trainers, the only ones it waits for; a
        ``dropped`` push carries nothing and is acknowledged, not counted.
        """
        engine, pending = self.engine, self.pending
        if dropped:
            return self._dropped(trainer_id, step, position)
        last = engine.roster.last_step
        arrival = counted_arrival(step, engine.step, trainer_id in pending.trainers, last.get(trainer_id, -1))
        if arrival is not NEW:
            if arrival is DUPLICATE:
                return False, engine.step  # a retry of a push counted or already applied
            if arrival is STALE:
                raise NotAllowed(
                    f"pserver {engine.endpoint}: trainer {trainer_id} pushed stale step "
                    f"{step}; the pserver is at step {engine.step}"
                )
            raise engine.rollbacks.refusal_ahead(trainer_id, "pushed step", step, engine.step)
        if step_trainers and not pending.admit(frozenset(step_trainers)):
            raise made_of_others(engine.endpoint, trainer_id, step, step_trainers, pending.admitted)
        pending.add(trainer_id, grads, sparse or {}, position)
        last[trainer_id] = step
        self.apply_if_complete()
        return True, engine.step

    def _dropped(self, trainer_id: int, step: int, position: Position) -> Tuple[bool, int]:
        """A push of a trainer dropped from ``step`` (backup trainers): acknowledged, its position kept,
        not counted."""
        engine = self.engine
        arrival = dropped_arrival(step, engine.step, trainer_id in self.pending.trainers)
        if arrival is AHEAD:
            raise engine.rollbacks.refusal_ahead(trainer_id, "pushed step", step, engine.step)
        if arrival is NEW:
            self.pending.drop(trainer_id, position)
            self.apply_if_complete()  # the step may have waited for this trainer until now
        last = engine.roster.last_step
        last[trainer_id] = max(step, last.get(trainer_id, -1))
        return False, engine.step

    def apply_if_complete(self) -> None:
        """Apply the step in progress if every expected trainer's push is counted: their mean."""
        engine, pending = self.engine, self.pending
        if not pending.complete(engine.roster.live(), engine.step):
            return
        mean, sparse = pending.mean()
        step = engine.step
        self.apply(mean, sparse, step)
        log.debug("%s: applied step %d from trainers %s", engine.endpoint, step, sorted(pending.trainers))
        engine.roster.positions.update(pending.positions)
        pending.applied(step + 1)
        engine.advance(step, mean, sparse)

    def on_close(self) -> None:
        self.apply_if_complete()

    def park_for_step(self, trainer_id: int, min_step: int) -> Optional[Parked]:
        """A wait for step ``min_step - 1`` to be applied (None: it is), within the barrier deadline.

        Refused at once when that step is ahead of this pserver, or needs this
        trainer's own push, which it has not made (a wait from before a roll-back).
        """
        engine = self.engine
        with engine.cv:
            if min_step > engine.step + 1:
                raise engine.rollbacks.refusal_ahead(trainer_id, "waits for update", min_step, engine.step)
            if engine.step >= min_step:
                return None
            if trainer_id in self._expected() - self.pending.trainers:
                engine.rollbacks.refuse_wait_from_before_a_roll_back(
                    trainer_id, f"wait for update {min_step}"
                )
            return engine.waits.park(
                lambda: engine.step >= min_step or self._abandoned_by_its_set(trainer_id, min_step - 1),
                f"step {engine.step}",
                lambda: sorted(self._expected() - self.pending.trainers),
                measured=True,
                trainer=trainer_id,
            )
