"""The Stepper interface: how a trainer takes a step, pulls, and fetches table rows, healing failures.

A :class:`~trainer.pserver_trainer.PserverTrainer` picks one stepper at
construction and hands it every step:

- :class:`~trainer.steppers.local.LocalStepper`: push-pull after backward (or
  streamed during it), waiting for the answer;
- :class:`~trainer.steppers.pipelined.PipelinedStepper`: async mode's
  pipeline, the push-pull sent in the background;
- :class:`~trainer.steppers.node.NodeStepper`: one local process of a trainer
  node, reducing gradients inside the node first;
- :class:`~trainer.steppers.geo.GeoStepper`: GEO mode, the optimizer run
  here and the change pushed every ``k_steps`` steps.

Every stepper reads and moves the same :class:`StepState`, owns the
trainer's :class:`~trainer.embedding.TableClient` (it pushes the tables'
gradients and fetches their rows), and heals a failed call through
:class:`~trainer.recovery.Recovery`. A step's push is one
:class:`~trainer.steppers.transfers.StepPush`, sent by :meth:`Stepper.push`
to every pserver in parallel and healed; a lookup's rows come through
:meth:`Stepper.fetch_rows`, healed the same way.
"""

from __future__ import annotations

import functools
import itertools
from abc import ABC, abstractmethod
from typing import Callable, Dict, List, NamedTuple, Optional

import torch

from transpiler import TrainerProgram

from ..blocks import LocalBlocks
from ..embedding import NextBatchPlan, RowFetch, RowsByPserver, TableClient, TouchedRows
from ..recovery import Decision, Recovery
from ..transport import Channels, TensorsByPserver
from .state import StepState
from .transfers import PushTensors, StepPush, Transfers

# The plan the feed made for the batch after the current one (None: none); waits for its reader.
TakeNextPlan = Callable[[], Optional[NextBatchPlan]]


class Pushed(NamedTuple):
    """What a step's push came to (:meth:`Stepper.push`)."""

    resync: Optional[Decision]  # the decision that moved the trainer elsewhere; None: the push went through
    pserver_steps: Dict[str, int]  # each pserver's step as its answer reported it (of the last attempt)


class Stepper(ABC):
    """How one trainer process steps, pulls and fetches rows (see the module doc)."""

    def __init__(
        self,
        program: TrainerProgram,
        model: torch.nn.Module,
        channels: Channels,
        blocks: LocalBlocks,
        recovery: Recovery,
        state: StepState,
        touched: Optional[TouchedRows] = None,
    ):
        self.program = program
        self.model = model
        self.channels = channels
        self.blocks = blocks
        self.recovery = recovery
        self.state = state
        self.sync_mode = program.sync_mode
        self.push_endpoints: List[str] = recovery.push_endpoints
        self.transfers = Transfers(channels, blocks)
        self.tables = TableClient(program.tables, program.pservers, self.fetch_rows, self._min_step, touched)
        # Listed at the first clear_grads (the trainer installs its tables and moves the model after building
        # the stepper), then kept: Module.zero_grad walks every submodule each call (60 µs of a job S step on
        # the 2-core machine, against 3 for the list).
        self._params: Optional[List[torch.nn.Parameter]] = None

    @property
    def speaks_for_trainer(self) -> bool:
        """Whether this process heartbeats and closes for its trainer (on a node, only its leader)."""
        return True

    def clear_grads(self) -> None:
        """``model.zero_grad(set_to_none=True)`` over the parameters the model had at its first step: every
        gradient dropped (the next backward makes new ones)."""
        if self._params is None:
            self._params = list(self.model.parameters())
        for p in self._params:
            p.grad = None

    def _min_step(self) -> int:
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
        outcome = self.recovery.heal(
            step, "joining", lambda: self.transfers.pull_all(step), self.transfers.pull_all
        )
        if outcome is not None:
            self.resynced(outcome)

    # -- stepping -----------------------------------------------------------

    @abstractmethod
    def step(self, prefetch: Optional[Dict[str, object]], take_next_plan: TakeNextPlan) -> None:
        """Push this step's gradients, pull fresh parameters, zero the gradients; move :class:`StepState`.

        ``prefetch`` ({table: ids} of the next batch) or else ``take_next_plan()``
        (the same, planned by the feed) rides along with the push.
        """

    def push(self, push: StepPush, first: Optional[Callable[[], Dict[str, int]]] = None) -> "Pushed":
        """Push ``push`` to every pserver it goes to, in parallel, healed: the one way a step's push goes.

        A failure that can heal re-syncs and the push goes again (pushes are
        idempotent), unless the decision moves the trainer elsewhere: then the
        parameters of that step are pulled and the decision returned in
        :attr:`Pushed.resync`. ``first``: what the first attempt does instead
        (ending the streams opened during backward, which cannot be resent).
        """
        attempts = itertools.chain(
            [first] if first is not None else [],
            itertools.repeat(functools.partial(self.transfers.push_all, push)),
        )
        pserver_steps: Dict[str, int] = {}

        def attempt() -> None:
            pserver_steps.update(next(attempts)() or {})

        return Pushed(self._heal(push.step, f"step {push.step}", attempt), pserver_steps)

    def _heal(self, step: int, what: str, calls: Callable[[], object]) -> Optional[Decision]:
        """Run ``calls`` (``what``, at ``step``), healing failures: None, or the decision that moved the
        trainer."""
        return self.recovery.heal(step, what, calls, self.transfers.pull_all)

    def pull(self) -> None:
        """Refresh the parameters (sync: as of the current step; async: latest), healing as a step does."""
        self.flush()
        step = self.state.step
        outcome = self._heal(step, f"pull at step {step}", lambda: self.transfers.pull_all(self._min_step()))
        if outcome is not None:
            self.resynced(outcome)

    def fetch_rows(self, fetch: RowFetch, min_step: int) -> RowsByPserver:
        """The rows ``fetch`` asks of the pservers (a lookup), healing a failure as a step does.

        When healing moved this trainer to another step (sync: a roll-back, or
        the others went on), the rows come from there and the current batch's
        step is discarded: its forward began before the re-sync.
        """
        fetched: RowsByPserver = {}
        step = self.state.step
        outcome = self._heal(
            step,
            f"lookup at step {step}",
            lambda: fetched.update(self.transfers.prefetch_all(fetch, min_step)),
        )
        if outcome is None:
            return fetched
        self.resynced(outcome)
        self.state.discard_batch()
        return self.transfers.prefetch_all(fetch, self._min_step())

    def plan_next_batch(self, ids: Dict[str, object]) -> NextBatchPlan:
        """The next batch's ``{table: ids}`` made ready to send with this step's push (the feed's thread)."""
        return self.tables.plan_next_batch(ids)

    def _next_plan(
        self, prefetch: Optional[Dict[str, object]], take_next_plan: TakeNextPlan
    ) -> Optional[NextBatchPlan]:
        """The next batch's ids to send with this step: ``prefetch`` given to step(), or what the feed
        planned."""
        if prefetch and self.program.tables:
            return self.plan_next_batch(prefetch)
        return take_next_plan()

    def push_tensors(self, tables: TensorsByPserver, next_ids: TensorsByPserver) -> PushTensors:
        """Per pserver pushed to: its blocks' gradients (read when sent), the ``tables``', then
        ``next_ids``."""
        return PushTensors(
            self.blocks,
            self.push_endpoints,
            {ep: tables.get(ep, []) + next_ids.get(ep, []) for ep in self.push_endpoints},
        )

    def _discarded(self) -> bool:
        """Drop this batch's step if a lookup of it re-synced (:meth:`StepState.discard_batch`); whether it
        did."""
        if not self.state.take_discarded():
            return False
        self._abandon()
        self.tables.clear()
        self.clear_grads()
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

    def end_epoch(self) -> None:
        """``batches()`` finished an epoch (the data position already at the next one's start): a stepper
        that pushes less often than every step (GEO) sends what it holds, at that position."""

    def leader_does(self, what: str, fn: Callable[[], object]):
        """``fn()`` once for the trainer (checkpoint, save_tables); on a node, the leader's result
        everywhere."""
        return fn()

    def finish(self) -> None:
        """The trainer closes: the last step reaches the pservers; may raise what that step raised."""
        self.flush()

    def close(self, timeout: Optional[float]) -> None:
        """Release the connections: ``Close`` every pserver, retrying up to ``timeout`` s (None: tell
        none)."""
        if timeout is None:
            self.channels.shutdown()
        else:
            self.channels.close(timeout)
