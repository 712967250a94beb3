"""Listeners of the engine's changes: checkpoints, exports and replication, handed to the engine at
construction.

ps-lite's servers take their request handle as a parameter; here the engine
(:class:`~pserver.engine.engine.Engine`) takes a list of :class:`UpdateListener` and tells each, in order
and under its lock, of every change it makes to its state: an update applied, a roster change that is no
update (a trainer closed or came back), and a reset to a checkpoint (resume or roll-back). The
implementations, built by :class:`pserver.server.ParameterServer`:

- :class:`Replication`: hands each change to the replicator while this process leads a replicated shard
  (hot standby), first, so the backup copies exactly what was applied; and, outside the engine's lock,
  the step sets of backup trainers' claims;
- :class:`ScheduledCheckpoints`: a checkpoint whenever one is due (the checkpoints a roll-back loads, and
  its record of closed trainers, are the engine's own: :mod:`.rollback`);
- :class:`ScheduledExports`: the tables' base and delta exports for serving.

A hot standby's backup writes no checkpoint and no export (its primary does) until it leads: both consult
one :class:`FileWrites` switch.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Mapping, Tuple

import torch

from ..checkpoint import Checkpointer
from ..tables import SparseGrad
from .roster import Roster

log = logging.getLogger(__name__)

# The ``lr_step`` of a replication message that carries backup trainers' step sets, not a change of state.
STEP_SETS = -2


class UpdateListener(ABC):
    """Told, under the engine's lock, of each change the engine makes to its state.

    The tensors are the engine's: valid during the call only (a sync engine
    reuses its sums at the next step). A listener never calls back into the engine.
    """

    @abstractmethod
    def on_update(
        self,
        lr_step: int,
        pserver_step: int,
        roster: Roster,
        dense: Mapping[str, torch.Tensor],
        sparse: Mapping[str, SparseGrad],
    ) -> None:
        """Gradients of step ``lr_step`` were applied (``dense`` by block, ``sparse`` by table),
        ``pserver_step`` now."""

    def on_roster(self, pserver_step: int, roster: Roster) -> None:
        """The roster changed without an update: a trainer closed or came back."""

    def on_reset(self, step: int) -> None:
        """The state was loaded from the checkpoint at ``step`` (resume or roll-back): what came after is
        abandoned."""


class Gate:
    """What the engine lets through while the job's layout changes: everything, unless a change of layout
    (:class:`pserver.layout.switch.LayoutSwitch`) stops the steps after its switch step. Called under the
    engine's lock; each refuses with a :mod:`pserver.errors` refusal."""

    def check_push(self, trainer_id: int, step: int) -> None:
        """Refuse ``trainer_id``'s push of ``step``."""

    def check_wait(self, trainer_id: int, min_step: int) -> None:
        """Refuse ``trainer_id``'s wait for ``min_step`` updates."""

    def check_hello(self, trainer_id: int) -> None:
        """Refuse ``trainer_id``'s Hello."""

    def on_lead(self) -> None:
        """Hot standby: this process, a backup, leads its shard from now on."""


class FileWrites:
    """Whether this process writes checkpoints and exports: a hot standby's backup leaves them to its
    primary."""

    def __init__(self, on: bool = True):
        self._on = on

    @property
    def on(self) -> bool:
        return self._on

    def take_over(self) -> None:
        """This process leads its shard from now on: it writes them."""
        self._on = True


class Replication(UpdateListener):
    """The engine's side of hot standby: every change, while this process leads, to its replicator.

    The replicator (:class:`pserver.replication.outbox.Outbox`) encodes each
    change at once and sends it to the backup; :meth:`lead` installs it when
    the process starts to lead (under the engine's lock). A roll-back makes the
    backup's copy useless: it copies the state again.
    """

    def __init__(self):
        self._outbox = None

    def lead(self, outbox) -> None:
        """Under the engine's lock: hand every later change to ``outbox``."""
        self._outbox = outbox

    def on_update(self, lr_step, pserver_step, roster, dense, sparse) -> None:
        if self._outbox is not None:
            self._outbox.record(lr_step, pserver_step, roster.to_meta(), dense, sparse)

    def on_roster(self, pserver_step: int, roster: Roster) -> None:
        if self._outbox is not None:
            self._outbox.record(-1, pserver_step, roster.to_meta(), {}, {})

    def on_reset(self, step: int) -> None:
        if self._outbox is not None:
            self._outbox.reset()

    def record_step_sets(self, sets: Mapping[int, Tuple[int, ...]]) -> None:
        """Backup trainers' step sets, as the first pserver's claims make them (not under the engine's lock:
        a message of its own, which changes no state the engine holds)."""
        outbox = self._outbox
        if outbox is not None:
            outbox.record(STEP_SETS, 0, {"step_sets": {str(s): list(t) for s, t in sets.items()}}, {}, {})


class ScheduledCheckpoints(UpdateListener):
    """A checkpoint every ``checkpoint_every`` updates (see :meth:`Checkpointer.due`)."""

    def __init__(self, checkpointer: Checkpointer, files: FileWrites, endpoint: str):
        self.checkpointer = checkpointer
        self.files = files
        self.endpoint = endpoint

    def on_update(self, lr_step, pserver_step, roster, dense, sparse) -> None:
        if self.files.on and self.checkpointer.due(pserver_step):
            try:
                self.checkpointer.save(pserver_step, roster.to_meta())
            except Exception:  # a full disk must not fail the push that was just applied
                log.exception(
                    "%s: checkpoint at step %d failed; training goes on and the previous "
                    "checkpoint stays the latest",
                    self.endpoint,
                    pserver_step,
                )


class ScheduledExports(UpdateListener):
    """The table exports for serving (:class:`pserver.tables.serving.exporter.TableExporter`), when due."""

    def __init__(self, exporter, files: FileWrites):
        self.exporter = exporter
        self.files = files

    def on_update(self, lr_step, pserver_step, roster, dense, sparse) -> None:
        if self.files.on:
            self.exporter.after_update(pserver_step)

    def on_reset(self, step: int) -> None:
        self.exporter.restored()
