"""SyncEngine: step *s* is applied once every expected trainer's gradient for *s* has arrived.

The update uses the mean over the trainers that pushed the step, so N trainers
on batch b equal one process on the concatenated N*b batch.
"""

from __future__ import annotations

import logging
from typing import Dict, Mapping, Optional, Sequence, Tuple

import torch

from ..errors import NotAllowed
from ..tables import SparseGrad
from .engine import Engine
from .pending import PendingStep
from .roster import Position
from .waits import Parked

log = logging.getLogger(__name__)


class SyncEngine(Engine):
    """Applies step s once all live trainers pushed it, with their mean gradient.

    Its step in progress is a :class:`~pserver.engine.pending.PendingStep`
    part (``pending``), which the engine's roll-backs clear too.
    """

    sync_mode = True

    def __init__(self, store, *args, **kwargs):
        super().__init__(store, *args, pending=PendingStep(store.dense_sums()), **kwargs)

    def _start_step(self, trainer_id: int, how: str, join_at: int) -> int:
        later = []
        if how == "rejoined" and self.pending.trainers:
            # The step in progress goes on without it: waiting for a trainer that has
            # to pull first would stall it, and a late gradient would be stale.
            later.append(self.step + 1)
        if join_at == self.step + 1:
            # The trainer found another pserver a step ahead and starts there: this one finishes its
            # step without it. Waiting for it would deadlock, as it waits for the pservers to agree
            # (and its repeated Hellos keep it from being dropped). Further ahead is a roll-back's
            # business, not a join's: ignored.
            later.append(join_at)
        if later:
            self.pending.join_later(trainer_id, max(later))
            # The others' pushes of the step in progress may all be here already: no later push
            # would come to complete it (theirs wait for this very step).
            self._apply_if_complete()
        return max(self.pending.joins_at_step(trainer_id), self.step)

    def _others_in_step(self, trainer_id: int) -> int:
        return len((self.pending.trainers | self._expected()) - {trainer_id})

    def _expected(self) -> set:
        return self.pending.expected(self.roster.live(), self.step)

    def push(
        self,
        trainer_id: int,
        step: int,
        grads: Dict[str, torch.Tensor],
        sparse: Optional[Mapping[str, SparseGrad]] = None,
        position: Position = (0, 0),
        park: bool = False,
        step_trainers: Sequence[int] = (),
        dropped: bool = False,
    ) -> Tuple[bool, int]:
        """Count ``grads`` and ``sparse`` for ``step``; returns (counted, the pserver's step). Applies when
        complete.

        ``grads`` are copied into the step's sums: the caller keeps its buffers. ``sparse`` ({table: (ids,
        rows)}) is kept until the step is applied: the caller must not reuse it. Backup trainers
        (:mod:`.services.claims`): ``step_trainers`` are the step's trainers, the only ones it waits for; a
        ``dropped`` push carries nothing and is acknowledged, not counted.
        """
        with self.cv:
            self.roster.check_pusher(trainer_id, self.endpoint, self.step)
            if dropped:
                return self._dropped(trainer_id, step, position)
            if step == self.step and trainer_id in self.pending.trainers:
                return False, self.step
            if step < self.step:
                if self.last_step.get(trainer_id, -1) >= step:
                    return False, self.step  # a retry of a push already applied
                raise NotAllowed(
                    f"pserver {self.endpoint}: trainer {trainer_id} pushed stale step "
                    f"{step}; the pserver is at step {self.step}"
                )
            if step > self.step:
                raise self.rollbacks.refusal_ahead(trainer_id, "pushed step", step, self.step)
            if step_trainers and not self.pending.admit(frozenset(step_trainers)):
                raise NotAllowed(
                    f"pserver {self.endpoint}: trainer {trainer_id} pushed step {step} as made of "
                    f"trainers {sorted(step_trainers)}, but the step is made of "
                    f"{sorted(self.pending.admitted)}"
                )
            self.pending.add(trainer_id, grads, sparse or {}, position)
            self.last_step[trainer_id] = step
            self._apply_if_complete()
            return True, self.step

    def _dropped(self, trainer_id: int, step: int, position: Position) -> Tuple[bool, int]:
        """A push of a trainer dropped from ``step`` (backup trainers): acknowledged, its position kept,
        not counted."""
        if step > self.step:
            raise self.rollbacks.refusal_ahead(trainer_id, "pushed step", step, self.step)
        if step == self.step and trainer_id not in self.pending.trainers:
            self.pending.drop(trainer_id, position)
            self._apply_if_complete()  # the step may have waited for this trainer until now
        self.last_step[trainer_id] = max(step, self.last_step.get(trainer_id, -1))
        return False, self.step

    def _apply_if_complete(self) -> None:
        pending = self.pending
        if not pending.complete(self.roster.live(), self.step):
            return
        mean, sparse = pending.mean()
        step = self.step
        self.store.apply(mean, step)
        self.tables.apply(sparse, step)
        log.debug("%s: applied step %d from trainers %s", self.endpoint, step, sorted(pending.trainers))
        self.step += 1
        self.roster.positions.update(pending.positions)
        pending.applied(self.step)
        self._applied(step, mean, sparse)
        self.waits.notify()

    def _on_close(self) -> None:
        self._apply_if_complete()

    def park_for_step(self, trainer_id: int, min_step: int) -> Optional[Parked]:
        """A wait for step ``min_step - 1`` to be applied (None: it is), within the barrier deadline.

        Refused at once when that step is ahead of this pserver, or needs this
        trainer's own push, which it has not made (a wait from before a roll-back).
        """
        with self.cv:
            if min_step > self.step + 1:
                raise self.rollbacks.refusal_ahead(trainer_id, "waits for update", min_step, self.step)
            if self.step >= min_step:
                return None
            if trainer_id in self._expected() - self.pending.trainers:
                self.rollbacks.refuse_wait_from_before_a_roll_back(trainer_id, f"wait for update {min_step}")
            return self.waits.park(
                lambda: self.step >= min_step,
                f"step {self.step}",
                lambda: sorted(self._expected() - self.pending.trainers),
                measured=True,
                trainer=trainer_id,
            )

    def _reads_need_copy(self) -> bool:
        # Between two sync steps nothing writes the blocks: the next update
        # needs this very trainer's next push, which follows its pull.
        return False
