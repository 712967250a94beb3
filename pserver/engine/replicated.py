"""The engine's side of hot standby (README "Hot standby"): what it hands its replicator, what a backup applies.

:class:`Replicated` is a mixin of :class:`~pserver.engine.base.Engine`, like
:class:`~pserver.engine.rollback.Checkpoints`. On a primary, every change of the
state (an applied update, a trainer that closed or came back) is handed, under
the engine's lock, to ``replicator`` (:class:`pserver.replication.outbox.Outbox`),
which encodes it at once and sends it to the backup. On a backup,
:meth:`apply_replicated` applies the same update the same way, so both hold the
same bits: the step's mean gradient is computed once, on the primary, and
never again from pushes whose order could differ.
"""
from __future__ import annotations

import logging
import time
from typing import Dict, Mapping

import torch

from ..tables import SparseGrad

log = logging.getLogger(__name__)


class Replicated:
    """Hand changes to the replicator (primary); apply the primary's changes (backup); take the lead."""

    # The replicator (primary with replicas) or None; set by the server.
    replicator = None
    # Whether this process writes checkpoints and exports: a backup leaves them to its primary.
    writes_files = True

    def _replicate(self, lr_step: int, dense: Mapping[str, torch.Tensor], sparse: Mapping[str, SparseGrad]) -> None:
        """Under the lock: hand the update just applied (or, ``lr_step`` -1, a roster change) to the replicator."""
        if self.replicator is not None:
            self.replicator.record(lr_step, self.updates, self.roster.to_meta(), dense, sparse)

    def _replicate_roster(self) -> None:
        """Under the lock: a roster change that is no update (a trainer closed or came back)."""
        self._replicate(-1, {}, {})

    def apply_replicated(self, lr_step: int, updates: int, roster_meta: dict, dense: Dict[str, torch.Tensor],
                         sparse: Mapping[str, SparseGrad]) -> None:
        """Backup: apply the primary's update (``lr_step`` -1: its roster alone) and take its count and roster.

        The dense gradients and the merged table gradients are the ones the
        primary applied with the learning rate of ``lr_step``; trainers' progress
        and who closed come as the primary's roster after it.
        """
        with self.cv:
            if lr_step >= 0:
                self.store.apply(dense, lr_step)
                self.tables.apply(sparse, lr_step)
            self.updates = updates
            self.roster.follow(roster_meta)
            if set(range(self.trainers)) <= self.roster.closed:
                self.all_closed.set()
            self.cv.notify_all()

    def take_lead(self) -> None:
        """A backup becomes the primary: every live trainer that pushed is expected, as if just heard from.

        The backup heard from no trainer; those that do not come within
        heartbeat_timeout are dropped as on any primary.
        """
        with self.cv:
            now = time.monotonic()
            # Only those that pushed: a trainer yet to say its first Hello is not waited for by the
            # heartbeat watchdog, as on any pserver (a fresh shard's first primary has none).
            for t in self.roster.live() & set(self.roster.last_step):
                self.roster.joined.add(t)
                self.roster.last_seen[t] = now
            self.writes_files = True
            self.cv.notify_all()
        log.info("%s: leads its shard at update %d", self.endpoint, self.updates)
