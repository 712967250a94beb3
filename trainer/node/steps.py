"""How the local processes of a trainer node join, step, pull and heal as one trainer.

Local rank 0 (the *leader*) speaks for the node where one voice is needed:
it says Hello to every pserver (the sessions it gets are shared by all local
ranks), heartbeats, re-syncs after a failure and sends Close. Everything else
is split: each local rank pushes and pulls the blocks of its own pservers
(:class:`~trainer.node.group.NodeGroup`), and looks up its own batch's table rows.

A failure anywhere reaches every local rank through the status slots of the
step's collectives, so they all take the same way on: a retry of the step's
transfers (pushes are idempotent), or the leader's re-sync, whose decision,
sessions and parameters it broadcasts. A lookup that failed spoils its
batch: the node then pushes nothing and trains the batch again
(:meth:`Trainer.batches` replays it).
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..blocks import LocalBlocks
from ..communicator import Communicator
from ..errors import DOWN, PserverError
from ..recovery import RETRY, Decision, Recovery, recoverable
from .group import FATAL, OK, RECOVERABLE, NodeError, NodeGroup

log = logging.getLogger(__name__)

# A step whose batch is trained again: a lookup of it failed, nothing was pushed.
REPLAY = "replay"


class NodeSteps:
    """The node-wide side of a trainer's join, step, pull and re-sync (local ranks >= 2)."""

    def __init__(self, group: NodeGroup, comm: Communicator, recovery: Recovery, blocks: LocalBlocks,
                 pull_all: Callable[[int], None], recovery_timeout: float):
        self.group = group
        self.comm = comm
        self.recovery = recovery
        self.blocks = blocks
        self.pull_all = pull_all
        self.recovery_timeout = recovery_timeout
        self.node_id = group.node_id

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
            raise NodeError(f"trainer node {self.node_id}, local rank {self.group.rank}: {what} failed on "
                            f"local rank 0: {value}")
        return value

    def join(self, leader_join: Callable[[], Tuple[int, Tuple[int, int]]]) -> Tuple[int, Tuple[int, int]]:
        """The leader joins (Hello, first pull); every rank gets its step, data position and parameters."""
        def joined():
            step, position = leader_join()
            return step, position, dict(self.comm.sessions)

        step, position, sessions = self._from_leader("joining the pservers", joined)
        self.comm.sessions = dict(sessions)
        self.group.broadcast_params(self.blocks.view)
        return step, position

    def step(self, step: int, position: Tuple[int, int], lookup_error: Optional[PserverError],
             table_grads: Callable[[], Dict[str, List[Tuple[str, torch.Tensor]]]],
             push_endpoints: List[str]):
        """Reduce, push this rank's share, gather the node's fresh blocks; None, REPLAY or a Decision.

        ``table_grads()`` gives the node's merged table gradients routed per
        pserver (a collective: every rank calls it, after the dense reduce).
        """
        share, failed = self.group.reduce_grads(self.blocks.grad_rows, lookup_error is not None)
        if failed:
            return self._replay(step, lookup_error)
        sparse = table_grads()
        mine = [ep for ep in push_endpoints if ep in self.group.endpoints]
        grads: Dict[str, list] = {ep: [] for ep in mine}
        for name, t in share:
            grads[self.blocks.by_name[name].endpoint].append((name, t))
        for ep in mine:
            grads[ep] += sparse.get(ep, [])
        dest = self.group.param_dest
        return self.transfer(step, f"step {step}", lambda: self.comm.run_parallel(
            {ep: (lambda ep=ep: self.comm.push_pull(ep, step, grads[ep], self.blocks.expect, dest, position))
             for ep in mine}))

    def pull(self, step: int, min_updates: int) -> Optional[Decision]:
        """Each rank pulls its pservers' blocks; the node gathers them (healing as one)."""
        mine = [ep for ep in self.group.endpoints if ep in self.blocks.by_endpoint]

        def pull_mine():
            self.comm.run_parallel({ep: (lambda ep=ep: self.comm.pull(
                ep, [b.name for b in self.blocks.by_endpoint[ep]], min_updates, self.blocks.expect,
                self.group.param_dest)) for ep in mine})
        return self.transfer(step, f"pull at step {step}", pull_mine)

    def transfer(self, step: int, what: str, calls: Callable[[], object]) -> Optional[Decision]:
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
                raise NodeError(f"trainer node {self.node_id}: {what} failed on another local rank with an "
                                f"error that does not heal (its log says which)")
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
        log.warning("trainer node %d, local rank %d: %s failed; the batch is trained again", self.node_id,
                    self.group.rank, what)
        return REPLAY if decision.action == RETRY else self._move(decision, what)

    def _resync(self, error: Optional[PserverError], step: int, deadline: float, what: str) -> Decision:
        """The leader waits for the pservers and decides; every rank gets the decision and sessions."""
        def decide():
            failure = error or PserverError(f"trainer node {self.node_id}", f"{what} failed on another local "
                                            f"rank", DOWN)
            return self.recovery.resync(failure, step, deadline, what), dict(self.comm.sessions)

        decision, sessions = self._from_leader(what, decide)
        self.comm.sessions = dict(sessions)
        return decision

    def _move(self, decision: Decision, what: str) -> Decision:
        """The leader pulls the parameters of the step the decision moves to; every rank gets them."""
        def pull():
            outcome = self.recovery.heal(decision.step, what, lambda: self.pull_all(decision.step), self.pull_all)
            return outcome or decision, dict(self.comm.sessions)

        final, sessions = self._from_leader(what, pull)
        self.comm.sessions = dict(sessions)
        self.group.broadcast_params(self.blocks.view)
        return final

    def leader_does(self, what: str, fn: Callable[[], object]):
        """``fn()`` once for the node (checkpoint, save_tables), its result on every rank."""
        return self._from_leader(what, fn)
