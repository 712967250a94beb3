"""The Stepper interface: how a trainer takes a step, pulls, and fetches table rows, healing failures.

A :class:`~trainer.trainer.PserverTrainer` picks one stepper at
construction and hands it every step:

- :class:`~trainer.steppers.local.LocalStepper`: push-pull after backward (or
  streamed during it), waiting for the answer;
- :class:`~trainer.steppers.pipelined.PipelinedStepper`: async mode's
  pipeline, the push-pull sent in the background;
- :class:`~trainer.steppers.node.NodeStepper`: one local process of a trainer
  node, reducing gradients inside the node first.

Every stepper reads and moves the same :class:`StepState`, owns the
trainer's :class:`~trainer.embedding.TableClient` (it pushes the tables'
gradients and fetches their rows), and heals a failed call through
:class:`~trainer.recovery.Recovery`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Dict, List, Optional

import torch

from transpiler import TrainerProgram

from ..blocks import LocalBlocks
from ..communicator import Communicator
from ..embedding import AheadPlan, Pieces, TableClient, prefetch_all
from ..recovery import Decision, Recovery
from .state import StepState
from .transfers import Transfers

# What the feed prepared for the batch after the current one (None: nothing); waits for its reader.
Prepared = Callable[[], Optional[AheadPlan]]


class Stepper(ABC):
    """How one trainer process steps, pulls and fetches rows (see the module doc)."""

    def __init__(self, program: TrainerProgram, model: torch.nn.Module, comm: Communicator, blocks: LocalBlocks,
                 recovery: Recovery, state: StepState):
        self.program = program
        self.model = model
        self.comm = comm
        self.blocks = blocks
        self.recovery = recovery
        self.state = state
        self.sync_mode = program.sync_mode
        self.push_endpoints: List[str] = recovery.push_endpoints
        self.transfers = Transfers(comm, blocks)
        self.tables = TableClient(program.tables, program.pservers, self.fetch_rows, self._min_updates)

    @property
    def speaks_for_trainer(self) -> bool:
        """Whether this process heartbeats and closes for its trainer (on a node, only its leader)."""
        return True

    def _min_updates(self) -> int:
        """The updates a read waits for: sync, the current step; async, none."""
        return self.state.step if self.sync_mode else 0

    # -- joining ------------------------------------------------------------

    def join(self) -> None:
        """Register with every pserver and pull the parameters of the step they stand at.

        A pserver lost before the first pull is waited for and re-synced with,
        as in a step (see :class:`~trainer.recovery.Recovery`).
        """
        joined = self.recovery.join()
        self.state.advance(joined.step, joined.position)
        step = joined.step
        outcome = self.recovery.heal(step, "joining", lambda: self.transfers.pull_all(step), self.transfers.pull_all)
        if outcome is not None:
            self.resynced(outcome)

    # -- stepping -----------------------------------------------------------

    @abstractmethod
    def step(self, prefetch: Optional[Dict[str, object]], prepared: Prepared) -> None:
        """Push this step's gradients, pull fresh parameters, zero the gradients; move :class:`StepState`.

        ``prefetch`` ({table: ids} of the next batch) or else ``prepared()``
        (the same, prepared by the feed) rides along with the push.
        """

    def pull(self) -> None:
        """Refresh the parameters (sync: as of the current step; async: latest), healing as a step does."""
        self.flush()
        step = self.state.step
        outcome = self.recovery.heal(step, f"pull at step {step}",
                                     lambda: self.transfers.pull_all(self._min_updates()), self.transfers.pull_all)
        if outcome is not None:
            self.resynced(outcome)

    def fetch_rows(self, pieces: Pieces, min_updates: int) -> Dict[str, Dict[str, torch.Tensor]]:
        """Rows of ``pieces`` from the pservers (a lookup), healing a failure as a step does.

        When healing moved this trainer to another step (sync: a roll-back, or
        the others went on), the rows come from there and the current batch's
        step is discarded: its forward began before the re-sync.
        """
        fetched: Dict[str, Dict[str, torch.Tensor]] = {}
        step = self.state.step
        outcome = self.recovery.heal(step, f"lookup at step {step}",
                                     lambda: fetched.update(prefetch_all(self.comm, self.tables, pieces, min_updates)),
                                     self.transfers.pull_all)
        if outcome is None:
            return fetched
        self.resynced(outcome)
        self.state.discard = True
        return prefetch_all(self.comm, self.tables, pieces, self._min_updates())

    def prepare_ahead(self, ids: Dict[str, object]) -> AheadPlan:
        """The next batch's ``{table: ids}`` made ready to send with this step's push (the feed's thread)."""
        return self.tables.plan_ahead(ids)

    def _plan(self, prefetch: Optional[Dict[str, object]], prepared: Prepared) -> Optional[AheadPlan]:
        """The next batch's ids to send ahead: ``prefetch`` given to step(), or what the feed prepared."""
        if prefetch and self.program.tables:
            return self.prepare_ahead(prefetch)
        return prepared()

    def gradients(self, sparse: Pieces, extra: Pieces) -> Pieces:
        """Per pserver pushed to: its blocks' gradients, then table gradients, then ``extra`` (ids asked ahead)."""
        return {ep: self.blocks.grads(ep) + sparse.get(ep, []) + extra.get(ep, []) for ep in self.push_endpoints}

    def _discarded(self) -> bool:
        """Drop this batch's step if a lookup of it re-synced (:attr:`StepState.discard`); whether it did."""
        if not self.state.discard:
            return False
        self.state.discard = False
        self._abandon()
        self.tables.clear()
        self.model.zero_grad(set_to_none=True)
        return True

    def _abandon(self) -> None:
        """Give up what this step already sent (a stepper that streams during backward cancels it)."""

    def resynced(self, outcome: Decision) -> None:
        """Go on from where the pservers are after a restart or a drop (their parameters are pulled)."""
        self.tables.clear()
        self.state.moved(outcome)

    # -- around steps ---------------------------------------------------------

    def flush(self) -> None:
        """Wait until the steps taken so far reached the pservers (a pipeline sends in the background)."""

    def leader_does(self, what: str, fn: Callable[[], object]):
        """``fn()`` once for the trainer (checkpoint, save_tables); on a node, the leader's result everywhere."""
        return fn()

    def finish(self) -> None:
        """The trainer closes: the last step reaches the pservers; may raise what that step raised."""
        self.flush()

    def close(self, timeout: Optional[float]) -> None:
        """Release the connections: ``Close`` every pserver, retrying up to ``timeout`` s (None: tell none)."""
        if timeout is None:
            self.comm.shutdown()
        else:
            self.comm.close(timeout)
