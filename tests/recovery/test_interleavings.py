"""Recovery against real sync engines in one process: restarts and roll-backs interleaved call by call.

Two pservers' engines share a checkpoint directory; a restart is a new engine resumed from the latest
checkpoint under a new incarnation. Each trainer's :class:`~trainer.recovery.Recovery` talks to them through
in-process channels that keep its session per pserver incarnation (a call with a session from before a
restart is refused, as ABORTED is). What the chaos test reaches only by chance on a busy machine replays
here deterministically, decisions, tokens and engines included.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Dict

import pytest
import torch
from torch import nn

from pserver.checkpoint.checkpointer import Checkpointer
from pserver.engine import SyncEngine
from pserver.errors import MustResync
from pserver.store import BlockStore
from pserver.tables.table_set import TableSet
from tests.helpers.scripted_channels import run_parallel
from trainer.errors import DOWN, RESYNC, PserverError
from trainer.recovery import ROLLBACK, Recovery
from trainer.recovery.decide import JOIN
from transpiler import DistributeTranspiler, DistributeTranspilerConfig, Program

A, B = "127.0.0.1:1", "127.0.0.1:2"  # pserver 0 holds the weight, pserver 1 the bias


def plan() -> DistributeTranspiler:
    torch.manual_seed(0)
    t = DistributeTranspiler(DistributeTranspilerConfig())
    t.transpile(
        0, program=Program(nn.Linear(4, 2), "sgd", lr=0.5), pservers=f"{A},{B}", trainers=2, sync_mode=True
    )
    return t


class Pservers:
    """Both pservers' engines over ``checkpoint_dir``; :meth:`restart` resumes one from the latest
    checkpoint."""

    def __init__(self, checkpoint_dir: str):
        self.plan, self.dir = plan(), checkpoint_dir
        self.engines: Dict[str, SyncEngine] = {}
        self.incarnations: Dict[str, int] = {}
        for ep in (A, B):
            self.restart(ep)

    def restart(self, ep: str) -> None:
        ps = self.plan.get_pserver_program(ep)
        store, tables = BlockStore(ps, self.plan.get_startup_program(ep, ps)), TableSet(ps)
        checkpointer = Checkpointer(self.dir, store, tables, [A, B].index(ep), 2, ep, True)
        engine = SyncEngine(store, tables, 2, ep, barrier_timeout=5.0, checkpointer=checkpointer)
        engine.resume()
        self.engines[ep] = engine
        self.incarnations[ep] = self.incarnations.get(ep, 0) + 1

    def checkpoint(self) -> None:
        for engine in self.engines.values():
            engine.checkpoint()

    def params(self) -> Dict[str, torch.Tensor]:
        return {n: b.detach().clone() for e in self.engines.values() for n, b in e.store.blocks.items()}


class Channels:
    """What :class:`Recovery` calls, for trainer ``trainer_id``, served by ``pservers``' engines in this
    process."""

    def __init__(self, pservers: Pservers, trainer_id: int):
        self.pservers, self.trainer_id = pservers, trainer_id
        self.sessions: Dict[str, int] = {}  # the incarnation each pserver's session was opened with
        self.answered_early: Dict[str, SimpleNamespace] = {}

    def hello_one(self, ep: str, join_at: int = 0) -> SimpleNamespace:
        j = self.pservers.engines[ep].hello(self.trainer_id, join_at)
        self.sessions[ep] = self.pservers.incarnations[ep]
        return SimpleNamespace(
            incarnation=self.pservers.incarnations[ep],
            start_step=j.step,
            sync_mode=True,
            checkpoint_step=j.checkpoint_step,
            epoch=j.position[0],
            batch=j.position[1],
            counted_step=j.counted_step,
            applied_step=j.applied_step,
            others_in_step=j.others_in_step,
        )

    def hello(self, timeout: float, join_at: int = 0):
        """Every pserver's answer; one answered ahead (:meth:`answer_early`) gives that answer."""
        return {ep: self.answered_early.pop(ep, None) or self.hello_one(ep, join_at) for ep in (A, B)}

    def answer_early(self, ep: str) -> None:
        """``ep`` answers this trainer's next Hello now (the other answers later, once it is up)."""
        self.answered_early[ep] = self.hello_one(ep)

    def _engine(self, ep: str) -> SyncEngine:
        if self.sessions.get(ep) != self.pservers.incarnations[ep]:
            raise PserverError(
                ep, f"ABORTED: trainer {self.trainer_id}'s session is not known here", RESYNC, "ABORTED"
            )
        return self.pservers.engines[ep]

    def __getitem__(self, ep: str) -> SimpleNamespace:
        return SimpleNamespace(
            restore=lambda step, token: self._engine(ep).restore(self.trainer_id, step, token)
        )

    def run_parallel(self, jobs):
        return run_parallel(jobs)

    def push(self, step: int, fail_at: str = "") -> None:
        """Push this trainer's gradients of ``step`` to both pservers (``fail_at``: that one's call was
        lost)."""

        def one(ep: str) -> None:
            if ep == fail_at:
                raise PserverError(
                    ep, f"step {step} failed: UNAVAILABLE: Stream removed", DOWN, "UNAVAILABLE"
                )
            engine = self._engine(ep)
            value = 1.0 + step + 10.0 * self.trainer_id  # the same gradient whenever the step is redone
            grads = {n: torch.full_like(b, value) for n, b in engine.store.blocks.items()}
            try:
                engine.push(self.trainer_id, step, grads, position=(0, step + 1))
            except MustResync as e:
                raise PserverError(ep, f"ABORTED: {e}", RESYNC, "ABORTED") from None

        self.run_parallel({ep: (lambda ep=ep: one(ep)) for ep in (A, B)})


def healing(channels: Channels, step: int, lost_at: str):
    """A step's calls as :meth:`Recovery.heal` runs them: the first failed at ``lost_at`` (its process
    died under it); a retry pushes the step to both pservers."""
    tries = []

    def calls():
        tries.append(step)
        if len(tries) == 1:
            raise PserverError(
                lost_at, f"step {step} failed: UNAVAILABLE: Stream removed", DOWN, "UNAVAILABLE"
            )
        channels.push(step)

    return calls


def reference(checkpoint_dir: str, steps: int) -> Dict[str, torch.Tensor]:
    """Both pservers' parameters after ``steps`` steps of both trainers without a failure."""
    pservers = Pservers(checkpoint_dir)
    trainers = [Channels(pservers, t) for t in (0, 1)]
    for t in trainers:
        t.hello(5.0)
    for step in range(steps):
        for t in trainers:
            t.push(step)
    return pservers.params()


def test_a_late_roll_back_for_a_restart_a_trainer_re_synced_past_leaves_no_step_stuck(tmp_path):
    """The chaos test's flake (seed 1, full suite, 2 busy cores), with checkpoint 1 for its 20.

    Trainer 1's Hello reached B before B restarted and A only after A's second restart, so its roll-back of B
    for A's restart failed (B no longer knew its session). It re-synced with both at checkpoint 1 and pushed
    step 1, which B applied with trainer 0's push while A waited for trainer 0. Trainer 0, whose call to A's
    previous process died, then saw A's restart and asked B to roll back for it. Had B never heard of that
    restart from trainer 1, it rolled back from step 2 to 1: trainer 0 waited at B for trainer 1's push of
    step 1, and trainer 1, its step 1 done, waited at A for trainer 0's push of step 2, B refusing its own.
    """
    pservers = Pservers(str(tmp_path / "ckpt"))
    t0, t1 = Channels(pservers, 0), Channels(pservers, 1)
    r0, r1 = (
        Recovery(c, sync_mode=True, push_endpoints=[A, B], connect_timeout=5, recovery_timeout=30)
        for c in (t0, t1)
    )
    assert r0.join().action == JOIN and r1.join().action == JOIN
    for step in range(3):
        if step == 1:
            pservers.checkpoint()
        for t in (t0, t1):
            t.push(step)
    assert [e.step for e in pservers.engines.values()] == [3, 3]

    t1.answer_early(B)  # trainer 1's step 3 failed at A; B answers its Hello at once
    for ep in (A, B):  # A and B restart within a second, both from checkpoint 1
        pservers.restart(ep)
    moved = r0.heal(3, "step 3", healing(t0, 3, lost_at=A), lambda step: None)
    assert (moved.action, moved.step) == (ROLLBACK, 1)
    with pytest.raises(PserverError, match="Stream removed"):
        t0.push(1, fail_at=A)  # B counts trainer 0's step 1; at A the call dies with the process:
    pservers.restart(A)  # A restarts again, from checkpoint 1

    moved = r1.heal(3, "step 3", healing(t1, 3, lost_at=A), lambda step: None)
    assert (moved.action, moved.step) == (ROLLBACK, 1)
    t1.push(1)  # B applies step 1 with both trainers; at A it waits for trainer 0
    assert (pservers.engines[A].step, pservers.engines[B].step) == (1, 2)

    # Trainer 0 sees A's restart: B already heard of it (from trainer 1) and is not rolled back; A needs
    # trainer 0's push of step 1, which B counted: it retries the step (RETRY), B acknowledging it again.
    assert r0.heal(1, "step 1", healing(t0, 1, lost_at=A), lambda step: None) is None
    assert (pservers.engines[A].step, pservers.engines[B].step) == (2, 2), (
        "B was rolled back behind trainer 1, whose step 1 is done: no step completes until barrier_timeout"
    )
    for t in (t1, t0):
        t.push(2)  # the job goes on: step 2 completes on both pservers
    assert (pservers.engines[A].step, pservers.engines[B].step) == (3, 3)
    got, expected = pservers.params(), reference(str(tmp_path / "reference"), 3)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0)


def test_a_restart_unseen_by_a_trainer_that_adopts_a_layout_rolls_back_no_step_it_did(tmp_path):
    """The chaos test's deadlock (seed 17, victim "old owner"): pserver 0 SIGKILLed right after the shrink
    committed, while the trainers adopted the next layout.

    Every pserver of the layout started from the checkpoint of the switch step (2). Trainer 0 adopted it
    first and pushed step 2: B counted it, the call to A died with A, which restarted from that checkpoint.
    Trainer 1 adopted it only then: its join saw A's restart as A's first sight, and its push of step 2
    completed the step on B (with trainer 0's push) while A waited for trainer 0. Trainer 0 then saw A's
    restart and asked B to roll back for it: had B not heard of it from trainer 1's join, it rolled back
    from step 3 to 2, and trainer 0 waited at B for trainer 1's push of step 2, while trainer 1, its step
    done, waited at A for trainer 0's push of step 3 (until barrier_timeout).
    """
    pservers = Pservers(str(tmp_path / "ckpt"))
    t0, t1 = Channels(pservers, 0), Channels(pservers, 1)
    for t in (t0, t1):
        t.hello(5.0)
    for step in range(2):
        for t in (t0, t1):
            t.push(step)
    pservers.checkpoint()  # the switch step's checkpoint: the next layout's pservers start from it
    for ep in (A, B):
        pservers.restart(ep)

    def adopting(channels: Channels) -> Recovery:
        return Recovery(channels, True, [A, B], connect_timeout=5, recovery_timeout=30, new_layout=True)

    r0 = adopting(t0)
    assert r0.join().action == JOIN  # trainer 0 adopts the layout first
    with pytest.raises(PserverError, match="Stream removed"):
        t0.push(2, fail_at=A)  # B counts trainer 0's step 2; at A the call dies with the process:
    pservers.restart(A)  # A restarts, from the switch step's checkpoint

    assert adopting(t1).join().action == JOIN  # trainer 1 adopts the layout: A's restart, unseen
    t1.push(2)  # B applies step 2 with both trainers; at A it waits for trainer 0
    assert (pservers.engines[A].step, pservers.engines[B].step) == (2, 3)

    # Trainer 0 sees A's restart: B heard of it from trainer 1's join and is not rolled back; trainer 0
    # retries step 2 (A needs its push, B acknowledges it again).
    assert r0.heal(2, "step 2", healing(t0, 2, lost_at=A), lambda step: None) is None
    assert (pservers.engines[A].step, pservers.engines[B].step) == (3, 3), (
        "B was rolled back behind trainer 1, whose step 2 is done: no step completes until barrier_timeout"
    )
    for t in (t1, t0):
        t.push(3)
    assert (pservers.engines[A].step, pservers.engines[B].step) == (4, 4)
    got, expected = pservers.params(), reference(str(tmp_path / "reference"), 4)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0)
