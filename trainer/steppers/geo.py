"""GeoStepper: GEO mode, where a trainer trains its own copy and syncs the change every ``k_steps`` steps.

Paddle's GEO-SGD (``a_sync_configs["k_steps"]``), docs/modes.md#geo. Each
step runs the program's optimizer here, on the dense parameters (with the
learning rate the pservers would use at this step), and sgd on the table rows
the step looked up (:class:`~trainer.embedding.TouchedRows`). Every
``k_steps`` steps, and whenever the trainer must stand where the pservers do
(a pull, a checkpoint, saving the tables, an epoch's end in ``batches()``,
closing), a *sync* pushes each block's change since the last sync (parameter -
base) and the touched rows' changes, as one ordinary push-pull per pserver (its
step: this trainer's step, so a retry is applied once), and the parameters it
pulls back, every trainer's changes added, become the new base. A pserver adds each change divided by
the number of trainers (``pserver.store.BlockStore``).

The optimizer's state (momentum, Adam's moments) lives here and survives
syncs; a trainer killed between syncs loses its unsynced steps (at most
``k_steps``) and that state, and resumes from its last sync's data position.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from transpiler.optim import LrSchedule

from ..embedding import NextBatchPlan, TouchedRows
from ..recovery import Decision
from .stepper import Stepper, TakeNextPlan
from .transfers import StepPush


class GeoStepper(Stepper):
    """One trainer process in GEO mode (see the module doc). Holds one copy of the dense parameters (the
    base)."""

    def __init__(self, *args):
        super().__init__(*args, touched=TouchedRows())
        self.k_steps = self.program.config.k_steps
        self.params = self.blocks.params
        self.optimizer = self.program.optimizer.build(self.params.values())
        self.schedule = LrSchedule(self.program.optimizer)
        self.table_schedules = {t.name: LrSchedule(t.optimizer) for t in self.program.tables}
        self.base: Dict[str, torch.Tensor] = {}
        self.unsynced = 0  # steps trained here since the last sync

    def join(self) -> None:
        super().join()
        self._rebase()

    def plan_next_batch(self, ids: Dict[str, object]) -> NextBatchPlan:
        """The next batch's ids deduplicated and routed, and their rows fetched now (the feed's thread).

        Its lookups read the rows touched since the last sync from here, the
        others from this plan; at a sync the ids ride with the push instead and
        their rows come back as of after it.
        """
        return self.tables.plan_next_batch(ids, self.transfers.prefetch_all)

    def step(self, prefetch: Optional[Dict[str, object]], take_next_plan: TakeNextPlan) -> None:
        if self._discarded():
            return
        step, position = self.state.step, self.state.next_position()
        plan = self._next_plan(prefetch, take_next_plan) if self.program.tables else None
        lr = self.schedule.lr_at(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        if self.program.tables:
            for table, (ids, grads) in self.tables.take_table_gradients().items():
                self.tables.touched.train(table, ids, grads, self.table_schedules[table].lr_at(step))
        self.clear_grads()
        self.unsynced += 1
        if self.unsynced < self.k_steps:
            if plan is not None:
                self.tables.install_next_batch(plan)
            self.state.advance(step + 1, position)
            return
        resync = self._sync(step, position, plan)
        if resync is None:
            self.state.advance(step + 1, position)
        else:
            self.resynced(resync)

    def _sync(self, step: int, position, plan: Optional[NextBatchPlan] = None) -> Optional[Decision]:
        """Push the change since the last sync as ``step``'s push, pull the sum; None, or the decision that
        moved us.

        ``plan``: the next batch's ids, asked with the push (their rows as of after it).
        """
        with torch.no_grad():
            for (
                name,
                p,
            ) in self.params.items():  # the blocks push what they read as gradients: here, the change
                p.grad = p.detach() - self.base[name]
        deltas = self.tables.route_gradients(self.tables.touched.take_deltas()) if self.program.tables else {}
        next_batch = self.tables.ask_next_batch(plan) if plan is not None else None
        next_rows = {ep: {} for ep in self.push_endpoints}
        push = StepPush(
            step,
            position,
            self.push_tensors(deltas, next_batch.ids if next_batch is not None else {}),
            next_batch,
            next_rows,
        )
        resync = self.push(push).resync
        self.clear_grads()
        self._rebase()
        if next_batch is not None and resync is None:
            self.tables.take_next_batch_rows(next_rows)
        return resync

    def _rebase(self) -> None:
        """The parameters as pulled are the base the next sync's change is measured from."""
        self.unsynced = 0
        with torch.no_grad():
            for name, p in self.params.items():  # into the same buffers, sync after sync
                if name in self.base:
                    self.base[name].copy_(p)
                else:
                    self.base[name] = p.detach().clone()

    def flush(self) -> None:
        """Sync now if this trainer trained since its last sync (its last step's push, at its data
        position)."""
        if self.unsynced:
            resync = self._sync(self.state.step - 1, self.state.position)
            if resync is not None:
                self.resynced(resync)

    def end_epoch(self) -> None:
        """Sync at each epoch's end of ``batches()`` (docs/modes.md): a trainer restarted later resumes at
        the next epoch's first batch with the epoch's last steps counted, not at the last window's start."""
        self.flush()

    def pull(self) -> None:
        super().pull()  # a sync first (flush), then the pull
        self._rebase()

    def resynced(self, outcome: Decision) -> None:
        """Healing pulled the pservers' parameters: the rows and changes trained since the last sync are
        gone."""
        super().resynced(outcome)
        self.tables.touched.clear()
        self._rebase()
