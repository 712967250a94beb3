"""NodeStepper: one local process of a trainer node; the node's processes join, step, pull and heal as one
trainer.

Local rank 0 (the *leader*) speaks for the node where one voice is needed: it says Hello to every pserver
(the sessions it gets are shared by all local ranks), heartbeats, re-syncs after a failure and sends Close.
Everything else is split: each local rank pushes and pulls the blocks of its own pservers
(:class:`~trainer.node.group.NodeGroup`), and looks up its own batch's table rows.

A failure anywhere reaches every local rank through the status slots of the step's collectives, so they all
take the same way on: a retry of the step's transfers (pushes are idempotent), or the leader's re-sync,
whose decision, sessions and parameters it broadcasts. A lookup that failed spoils its batch: the node then
pushes nothing and trains the batch again (``Trainer.batches`` replays it).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Callable, Dict, Optional

import torch

from transpiler.position import Position

from ..embedding import RowFetch, RowsByPserver
from ..errors import DOWN, PserverError
from ..node import FATAL, OK, RECOVERABLE, Layout, NodeError, NodeGroup, join_group, node_rendezvous
from ..recovery import RETRY, Decision, recoverable
from ..transport import TensorsByPserver
from .stepper import Stepper, TakeNextPlan
from .transfers import StepPush

log = logging.getLogger(__name__)

# A step whose batch is trained again: a lookup of it failed, nothing was pushed.
REPLAY = "replay"


class NodeStepper(Stepper):
    """A local rank of a trainer node (``local_world_size`` >= 2): reduce in the node, push its share,
    gather."""

    def __init__(
        self, *args, local_rank: int, local_world_size: int, device: torch.device, init_method: Optional[str]
    ):
        super().__init__(*args)
        cfg = self.program.config
        trainer_id = self.program.trainer_id
        rendezvous = node_rendezvous(os.environ, trainer_id, local_world_size, init_method)
        self._own_group = not torch.distributed.is_initialized()
        # Local ranks wait in collectives while their leader re-syncs or a barrier holds: allow for both.
        timeout = max(cfg.barrier_timeout, cfg.recovery_timeout) + cfg.rpc_timeout
        group = join_group(
            rendezvous.init_method,
            local_rank,
            local_world_size,
            device,
            timeout,
            f"trainer node {trainer_id} local rank {local_rank}",
            store=rendezvous.store,
        )
        try:
            layout = Layout(self.blocks.by_endpoint, self.program.pservers, local_world_size)
            self.group = NodeGroup(trainer_id, local_rank, layout, device, group)
        except BaseException:
            self._leave_group()
            raise
        self.node_id = trainer_id
        self.recovery_timeout = cfg.recovery_timeout
        # A lookup of this batch that failed (this rank's): the node replays the batch at step().
        self._lookup_error: Optional[PserverError] = None

    @property
    def speaks_for_trainer(self) -> bool:
        return self.group.is_leader

    def join(self) -> None:
        """The leader joins (Hello, first pull); every rank gets its step, data position and parameters."""

        def joined():
            super(NodeStepper, self).join()
            return self.state.step, self.state.position, self.channels.sessions()

        step, position, sessions = self._from_leader("joining the pservers", joined)
        self.channels.use_sessions(sessions)
        self.state.advance(step, Position(*position))
        self.group.broadcast_params(self.blocks.view)

    def fetch_rows(self, fetch: RowFetch, min_step: int) -> RowsByPserver:
        """A lookup of one local rank: a failure spoils the batch (zero rows), and the node heals at
        step()."""
        try:
            return self.transfers.prefetch_all(fetch, min_step)
        except PserverError as e:
            if not recoverable(e):
                raise
            self._lookup_error = self._lookup_error or e
        return fetch.zero_rows()

    def step(self, prefetch: Optional[Dict[str, object]], take_next_plan: TakeNextPlan) -> None:
        """Reduce, push and pull this rank's share, gather the node's fresh blocks (see the module doc)."""
        step, position = self.state.step, self.state.next_position()
        lookup_error, self._lookup_error = self._lookup_error, None
        outcome = self._step(step, position, lookup_error)
        self.tables.clear()
        self.clear_grads()
        if outcome is None:
            self.state.advance(step + 1, position)
            return
        if isinstance(outcome, Decision):
            self.resynced(outcome)
        self.state.rewind()  # batches() trains the batch again (moved or not)

    def _step(self, step: int, position: Position, lookup_error: Optional[PserverError]):
        """None when the step went through, REPLAY when the batch is trained again, or the Decision that
        moved."""
        share, failed = self.group.reduce_grads(self.blocks.grad_rows, lookup_error is not None)
        if failed:
            return self._replay(step, lookup_error)
        table_grads = self._table_grads()
        mine = [ep for ep in self.push_endpoints if ep in self.group.endpoints]
        grads: TensorsByPserver = {ep: [] for ep in mine}
        for name, t in share:
            grads[self.blocks.by_name[name].endpoint].append((name, t))
        for ep in mine:
            grads[ep] += table_grads.get(ep, [])
        return self.push(StepPush(step, position, grads, blocks_into=self.group.param_dest)).resync

    def _table_grads(self) -> TensorsByPserver:
        """The node's merged table gradients routed per pserver (a collective: every rank, after the dense
        reduce)."""
        if not self.program.tables:
            return {}
        dims = {t.name: (t.dim, getattr(torch, t.dtype)) for t in self.program.tables}
        return self.tables.route_gradients(
            self.group.merge_table_grads(self.tables.take_table_gradients(), dims)
        )

    def pull(self) -> None:
        """Each rank pulls its pservers' blocks; the node gathers them (healing as one)."""
        step = self.state.step
        mine = [ep for ep in self.group.endpoints if ep in self.blocks.by_endpoint]
        outcome = self._heal(
            step,
            f"pull at step {step}",
            functools.partial(self.transfers.pull_all, self._min_step(), mine, self.group.param_dest),
        )
        if outcome is not None:
            self.resynced(outcome)

    def _heal(self, step: int, what: str, calls: Callable[[], object]) -> Optional[Decision]:
        """Run this rank's ``calls``, then gather; on a failure anywhere, heal as one node.

        Returns None when the transfers went through everywhere (the fresh
        blocks are installed), or the decision that moved the node elsewhere
        (its parameters are installed).
        """
        deadline = None
        while True:
            error = None
            try:
                calls()
            except PserverError as e:
                error = e
            status = OK if error is None else RECOVERABLE if recoverable(error) else FATAL
            worst = self.group.gather_params(status, self.blocks.view)
            if worst == OK:
                return None
            if worst == FATAL:
                if error is not None and not recoverable(error):
                    raise error
                raise NodeError(
                    f"trainer node {self.node_id}: {what} failed on another local rank with an "
                    f"error that does not heal (its log says which)"
                )
            if deadline is None:
                deadline = time.monotonic() + self.recovery_timeout
            decision = self._resync(error, step, deadline, what)
            if decision.action != RETRY:
                return self._move(decision, what)

    def _replay(self, step: int, error: Optional[PserverError]) -> object:
        """A lookup failed somewhere: re-sync, and train the batch again (moved or not)."""
        deadline = time.monotonic() + self.recovery_timeout
        what = f"a lookup at step {step}"
        decision = self._resync(error, step, deadline, what)
        log.warning(
            "trainer node %d, local rank %d: %s failed; the batch is trained again",
            self.node_id,
            self.group.rank,
            what,
        )
        return REPLAY if decision.action == RETRY else self._move(decision, what)

    def _resync(self, error: Optional[PserverError], step: int, deadline: float, what: str) -> Decision:
        """The leader waits for the pservers and decides; every rank gets the decision and sessions."""

        def decide():
            failure = error or PserverError(
                f"trainer node {self.node_id}", f"{what} failed on another local rank", DOWN
            )
            return self.recovery.resync(failure, step, deadline, what), self.channels.sessions()

        decision, sessions = self._from_leader(what, decide)
        self.channels.use_sessions(sessions)
        return decision

    def _move(self, decision: Decision, what: str) -> Decision:
        """The leader pulls the parameters of the step the decision moves to; every rank gets them."""

        def pull():
            outcome = self.recovery.heal(
                decision.step, what, lambda: self.transfers.pull_all(decision.step), self.transfers.pull_all
            )
            return outcome or decision, self.channels.sessions()

        final, sessions = self._from_leader(what, pull)
        self.channels.use_sessions(sessions)
        self.group.broadcast_params(self.blocks.view)
        return final

    def _from_leader(self, what: str, fn: Callable[[], object]):
        """``fn()`` on the leader, its result (or its failure) on every local rank."""
        result = None
        if self.group.is_leader:
            try:
                result = ("ok", fn())
            except BaseException as e:
                self.group.broadcast(("error", f"{type(e).__name__}: {e}"))
                raise
        kind, value = self.group.broadcast(result)
        if kind == "error":
            raise NodeError(
                f"trainer node {self.node_id}, local rank {self.group.rank}: {what} failed on "
                f"local rank 0: {value}"
            )
        return value

    def leader_does(self, what: str, fn: Callable[[], object]):
        """``fn()`` once for the node (checkpoint, save_tables), its result on every rank."""
        return self._from_leader(what, fn)

    def finish(self) -> None:
        """All local ranks done: they meet, so the leader's Close comes after every rank's last step."""
        if not self.group.failed:
            self.group.barrier(f"trainer node {self.node_id} closing")

    def close(self, timeout: Optional[float]) -> None:
        """The leader of a node that did not fail closes; a failed node does not, so pservers wait for its
        restart."""
        try:
            super().close(timeout if self.group.is_leader and not self.group.failed else None)
        finally:
            self._leave_group()

    def _leave_group(self) -> None:
        """Destroy the node's process group if this trainer made it (a script's own group is left to it)."""
        if self._own_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
            self._own_group = False
