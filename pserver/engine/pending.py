"""PendingStep: what a sync pserver holds of the step in progress, and who joins it a step later.

The sync mode's handler (:mod:`.modes.sync`) counts every trainer's push of step *s* here
until the step is complete, then applies the mean. Dense gradients are summed
on arrival into one flat float64 buffer (:class:`pserver.flat.DenseSums`: one
add per push, the sum independent of the pushes' order) and sparse ones merged
on arrival (:mod:`pserver.tables.step_sums`), so what a step holds for its
pushes grows with the step's distinct ids, not with the number of trainers K:
per trainer only its id and data position. The engine's roll-backs and
a backup's state copy (:mod:`.rollback`) reach it through :meth:`PendingStep.clear`
and :meth:`PendingStep.forget_joins`: a step abandoned is never applied.

Not thread-safe: the engine holds its lock around every call.
"""

from __future__ import annotations

from typing import AbstractSet, Dict, FrozenSet, Mapping, Optional, Tuple, Union

import torch

from ..flat import DenseSums, FlatGrad, FlatLayout
from ..tables import SparseGrad
from ..tables.step_sums import SparseSums
from .roster import Position


class PendingStep:
    """The pushes counted for the step in progress, their sums, and the trainers that join at a later step.

    ``trainers``: those whose push of the step is counted; ``positions``: the
    data positions pushed with it (they count once the step is applied);
    ``joins_at``: trainers that (re)joined while a step was in progress (or
    found another pserver a step ahead), and the later step they count from.
    With backup trainers, ``admitted``: the step's trainers as its first push
    named them (None: every expected trainer), and ``dropped``: those that
    pushed it dropped (:mod:`.services.claims`). ``dense``: the step's dense sums
    (:meth:`pserver.store.BlockStore.dense_sums`; by default of no block).
    """

    def __init__(self, dense: Optional[DenseSums] = None):
        self.trainers: set = set()
        # The dense sums, allocated once and reused every step, with the blocks some trainer pushed in the
        # current step.
        self.dense = dense if dense is not None else DenseSums(FlatLayout.of([], "float32"), ())
        # Per table, the sums of the rows pushed in the current step, merged on arrival: bounded by
        # the step's distinct ids, not by the trainers (memory: pserver.tables.step_sums).
        self.sparse_sums = SparseSums()
        self.positions: Dict[int, Position] = {}
        self.joins_at: Dict[int, int] = {}
        self.admitted: Optional[FrozenSet[int]] = None
        self.dropped: set = set()

    def add(
        self,
        trainer_id: int,
        grads: Mapping[str, torch.Tensor],
        sparse: Mapping[str, SparseGrad],
        position: Position,
    ) -> None:
        """Count one trainer's push: ``grads`` and ``sparse`` are added into the step's sums (copied).

        ``grads``: by block name, or a :class:`~pserver.flat.FlatGrad` of the sums' layout (added whole).
        """
        if isinstance(grads, FlatGrad) and grads.layout == self.dense.layout:
            self.dense.add_flat(grads.flat, grads.present)
        elif grads:
            self.dense.add(grads)
        self.sparse_sums.add(sparse)
        self.trainers.add(trainer_id)
        self.positions[trainer_id] = position

    def expected(self, live: AbstractSet[int], pserver_step: int) -> set:
        """The ``live`` trainers the step after ``pserver_step`` applied waits for: all but those joining
        later (with backup trainers: of the step's trainers, all but those dropped)."""
        expected = {t for t in live if self.joins_at.get(t, 0) <= pserver_step} - self.dropped
        return expected if self.admitted is None else expected & self.admitted

    def admit(self, trainers: FrozenSet[int]) -> bool:
        """Backup trainers: the step is made of ``trainers`` (from a push); False if it was made of others."""
        if self.admitted is None:
            self.admitted = trainers
        return self.admitted == trainers

    def drop(self, trainer_id: int, position: Position) -> None:
        """Backup trainers: ``trainer_id`` pushed the step dropped; its data position counts once the step
        applies."""
        self.dropped.add(trainer_id)
        self.positions[trainer_id] = position

    def complete(self, live: AbstractSet[int], pserver_step: int) -> bool:
        """Whether some push is counted and every expected trainer's is."""
        return bool(self.trainers) and self.trainers >= self.expected(live, pserver_step)

    @property
    def touched(self) -> set:
        """The blocks some trainer pushed in the current step (by name)."""
        return {self.dense.layout.names[i] for i in self.dense.touched.nonzero()[0]}

    def mean(self) -> Tuple[Union[FlatGrad, Dict[str, torch.Tensor]], Dict[str, SparseGrad]]:
        """(dense, sparse) means over the trainers counted; dense: a flat gradient of the blocks touched
        (:meth:`pserver.flat.DenseSums.mean`), valid until the next step.

        Rows several trainers pushed are summed before the division, so the
        update equals one process's gradient of the concatenated batch.
        """
        n = len(self.trainers)
        return self.dense.mean(n), self.sparse_sums.mean(n)

    def applied(self, pserver_step: int) -> None:
        """The step was applied (``pserver_step`` now): forget its pushes and the join steps reached."""
        self.joins_at = {t: s for t, s in self.joins_at.items() if s > pserver_step}
        self.clear()

    def join_later(self, trainer_id: int, step: int) -> None:
        """``trainer_id`` counts from ``step`` on (or from a later step it was told before)."""
        self.joins_at[trainer_id] = max(self.joins_at.get(trainer_id, 0), step)

    def joins_at_step(self, trainer_id: int) -> int:
        """The step ``trainer_id`` was told it joins at, 0 if none."""
        return self.joins_at.get(trainer_id, 0)

    def clear(self) -> None:
        """Drop the pushes counted for the step in progress (the sums' buffers are kept for reuse)."""
        self.trainers = set()
        self.dense.clear()
        self.sparse_sums.clear()
        self.positions = {}
        self.admitted = None
        self.dropped = set()

    def forget_joins(self) -> bool:
        """Every trainer redoes the step the pserver stands at (a roll-back); whether one was told it joins
        later.

        Kept, the push of a trainer that had joined a step later (pservers apart) would be stale: the step
        it joined at was abandoned.
        """
        forgotten, self.joins_at = bool(self.joins_at), {}
        return forgotten
