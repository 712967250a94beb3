"""SyncEngine: step *s* is applied once every expected trainer's gradient for *s* has arrived.

The update uses the mean over the trainers that pushed the step, so N trainers
on batch b equal one process on the concatenated N*b batch.
"""
from __future__ import annotations

import logging
import time
from typing import Dict, List, Mapping, Optional, Tuple

import torch

from ..errors import NotAllowed
from ..tables import SparseGrad
from .base import Engine
from .roster import Position

log = logging.getLogger(__name__)


class SyncEngine(Engine):
    """Applies step s once all live trainers pushed it, with their mean gradient."""

    sync_mode = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pending: set = set()
        # Per-block sums, allocated once and reused every step; `touched`
        # holds the blocks some trainer pushed in the current step.
        self.grad_sum: Dict[str, torch.Tensor] = {}
        self.touched: set = set()
        # Per table, the (ids, rows) each trainer pushed in the current step.
        self.sparse_parts: Dict[str, List[SparseGrad]] = {}
        # Data positions pushed with the current step: they count once it is applied.
        self.pending_positions: Dict[int, Position] = {}
        # Trainers that (re)joined while a step was in progress, and the later step they count from.
        self.joins_at: Dict[int, int] = {}

    def _start_step(self, trainer_id: int, how: str, join_at: int) -> int:
        later = []
        if how == "rejoined" and self.pending:
            # The step in progress goes on without it: waiting for a trainer that has
            # to pull first would stall it, and a late gradient would be stale.
            later.append(self.updates + 1)
        if join_at == self.updates + 1:
            # The trainer found another pserver a step ahead and starts there: this one finishes its
            # step without it. Waiting for it would deadlock, as it waits for the pservers to agree
            # (and its repeated Hellos keep it from being dropped). Further ahead is a roll-back's
            # business, not a join's: ignored.
            later.append(join_at)
        if later:
            self.joins_at[trainer_id] = max(self.joins_at.get(trainer_id, 0), *later)
            # The others' pushes of the step in progress may all be here already: no later push
            # would come to complete it (theirs wait for this very step).
            self._apply_if_complete()
        return max(self.joins_at.get(trainer_id, 0), self.updates)

    def _others_in_step(self, trainer_id: int) -> int:
        return len((self.pending | self._expected()) - {trainer_id})

    def _expected(self) -> set:
        return {t for t in self.live() if self.joins_at.get(t, 0) <= self.updates}

    def _reset(self, meta: dict) -> None:
        super()._reset(meta)
        self._forget_join_steps()

    def _forget_join_steps(self) -> bool:
        # Every trainer redoes the checkpoint's step after a roll-back, also one that had joined a
        # step later (pservers apart): the step it joined at was abandoned. Kept, its push of the
        # checkpoint's step would be stale, the step applied without it.
        forgotten, self.joins_at = bool(self.joins_at), {}
        return forgotten

    def _clear_pending(self) -> None:
        self.pending = set()
        self.touched = set()
        self.sparse_parts = {}
        self.pending_positions = {}

    def push(self, trainer_id: int, step: int, grads: Dict[str, torch.Tensor],
             sparse: Optional[Mapping[str, SparseGrad]] = None,
             position: Position = (0, 0)) -> Tuple[bool, int]:
        """Count ``grads`` and ``sparse`` for ``step``; returns (counted, updates). Applies when complete.

        ``grads`` are copied into the step's sums: the caller keeps its
        buffers. ``sparse`` ({table: (ids, rows)}) is kept until the step is
        applied: the caller must not reuse it.
        """
        with self.cv:
            self._check_pusher(trainer_id)
            if step == self.updates and trainer_id in self.pending:
                return False, self.updates
            if step < self.updates:
                if self.last_step.get(trainer_id, -1) >= step:
                    return False, self.updates  # a retry of a push already applied
                raise NotAllowed(f"pserver {self.endpoint}: trainer {trainer_id} pushed stale step "
                                 f"{step}; the pserver is at step {self.updates}")
            if step > self.updates:
                raise self._ahead(trainer_id, "pushed step", step)
            for name, g in grads.items():
                if name in self.touched:
                    self.grad_sum[name].add_(g)
                else:
                    acc = self.grad_sum.get(name)
                    if acc is None:
                        acc = self.grad_sum[name] = torch.empty_like(g)
                    acc.copy_(g)
                    self.touched.add(name)
            for name, part in (sparse or {}).items():
                self.sparse_parts.setdefault(name, []).append(part)
            self.pending.add(trainer_id)
            self.pending_positions[trainer_id] = position
            self.last_step[trainer_id] = step
            self._apply_if_complete()
            return True, self.updates

    def _apply_if_complete(self) -> None:
        if not self.pending or not self.pending >= self._expected():
            return
        n = len(self.pending)
        mean = {name: self.grad_sum[name].div_(n) for name in self.touched}
        sparse = self.tables.mean_of(self.sparse_parts, n)
        step = self.updates
        self.store.apply(mean, step)
        self.tables.apply(sparse, step)
        log.debug("%s: applied step %d from trainers %s", self.endpoint, self.updates, sorted(self.pending))
        self.updates += 1
        self.joins_at = {t: s for t, s in self.joins_at.items() if s > self.updates}
        self.roster.positions.update(self.pending_positions)
        self._replicate(step, mean, sparse)
        self._clear_pending()
        self._checkpoint_and_export_if_due()
        self.cv.notify_all()

    def _on_close(self) -> None:
        self._apply_if_complete()

    def wait_updates(self, trainer_id: int, min_updates: int) -> None:
        """Block until step ``min_updates - 1`` is applied, within the barrier deadline.

        A call that had to wait reports how long to :attr:`on_wait` (the
        barrier wait histogram), after the lock is released.
        """
        started = None
        try:
            with self.cv:
                if min_updates > self.updates + 1:
                    raise self._ahead(trainer_id, "waits for update", min_updates)
                if self.updates < min_updates and trainer_id in self._expected() - self.pending:
                    # The step waited for needs this trainer's own push, which it has not made.
                    self._refuse_wait_from_before_a_roll_back(trainer_id, f"wait for update {min_updates}")
                if self.updates < min_updates:
                    started = time.monotonic()
                self._wait(lambda: self.updates >= min_updates, f"step {self.updates}",
                           lambda: sorted(self._expected() - self.pending))
        finally:
            if started is not None and self.on_wait is not None:
                self.on_wait(time.monotonic() - started)

    def _reads_need_copy(self) -> bool:
        # Between two sync steps nothing writes the blocks: the next update
        # needs this very trainer's next push, which follows its pull.
        return False
