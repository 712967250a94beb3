"""Backup trainers (``backup_trainers`` b, sync): a step applies with the first N - b trainers to claim it.

Every pserver applies the same trainers' gradients (the first pserver decides), so the model equals one
process fed, at each step, the batches of the trainers the step was made of; a trainer left out goes on
from the applied step, never rolling back.
"""

from __future__ import annotations

import threading
import time
from typing import Dict, List

import pytest
import torch
from torch import nn

from harness.cluster import LocalCluster
from harness.models import FLOAT64_EXACT, batches, odd_mlp, train_concatenated
from trainer.transport import PserverChannel
from transpiler import DistributeTranspiler, DistributeTranspilerConfig, Program

STEPS = 6


def program() -> Program:
    return Program(odd_mlp(dtype=torch.float64), "adam", lr=0.01, weight_decay=0.01)


def backups(b: int) -> DistributeTranspilerConfig:
    return DistributeTranspilerConfig(backup_trainers=b)


def assert_equal_to(state: dict, expected: dict) -> None:
    for name in expected:
        torch.testing.assert_close(state[name], expected[name], **FLOAT64_EXACT, msg=lambda m: f"{name}: {m}")


def step(tr, batch) -> None:
    x, y = batch
    nn.functional.cross_entropy(tr.model(x), y).backward()
    tr.step()


@pytest.mark.timeout(60)
def test_no_backup_trainers_is_plain_sync_and_claims_nothing():
    data = batches(2, 8, STEPS, dtype=torch.float64)
    with LocalCluster(program, 2, 2, config=backups(0)) as cluster:
        states = cluster.run_trainers(lambda tr, i: [step(tr, s[i]) for s in data] and tr.state_dict())
        assert all(s.claims is None for s in cluster.servers)
        assert [s.servicer.counters.dropped_pushes for s in cluster.servers] == [0, 0]
    assert_equal_to(states[0], train_concatenated(program(), data))


@pytest.mark.timeout(90)
def test_steps_apply_without_the_slow_trainer_which_goes_on_from_the_applied_step():
    """Trainer 2 of 3 (b = 1) is held until trainers 0 and 1 trained and closed: every step applied
    without it. Its first batch's push is dropped and answered with the parameters of step STEPS, where
    it goes on (no roll-back); alone then, its next step is made of it."""
    data = batches(3, 8, STEPS + 1, dtype=torch.float64)
    released = threading.Event()
    slow: Dict[str, object] = {}
    with LocalCluster(program, 2, 3, config=backups(1)) as cluster:

        def held():
            with cluster.trainer(2) as tr:
                assert released.wait(60)
                step(tr, data[0][2])  # computed on the parameters it joined with: dropped
                slow["after_drop"] = tr.step_count
                step(tr, data[STEPS][2])
                slow["state"] = tr.state_dict()

        thread = threading.Thread(target=held)
        thread.start()
        try:
            cluster.run_trainers(lambda tr, t: [step(tr, s[t]) for s in data[:STEPS]], ids=[0, 1])
        finally:
            released.set()
            thread.join(60)
        assert slow["after_drop"] == STEPS
        assert [s.servicer.counters.dropped_pushes for s in cluster.servers] == [1, 1]
        assert [s.engine.step for s in cluster.servers] == [STEPS + 1] * 2
    expected = train_concatenated(program(), [s[:2] for s in data[:STEPS]] + [[data[STEPS][2]]])
    assert_equal_to(slow["state"], expected)


@pytest.mark.timeout(120)
def test_with_a_straggler_every_step_is_the_mean_of_the_trainers_it_was_made_of(monkeypatch):
    """Three trainers race, trainer 2 the slowest; whatever the first pserver decided at each step
    (recorded from its answers), the model is one process's fed those trainers' batches."""
    made: Dict[int, tuple] = {}
    claim = PserverChannel.claim

    def recorded(channel, at):
        reply = claim(channel, at)
        if reply.admitted:
            made[at] = tuple(reply.trainers)
        return reply

    monkeypatch.setattr(PserverChannel, "claim", recorded)
    data = batches(3, 8, 3 * STEPS, dtype=torch.float64)
    slow_steps: List[int] = []
    with LocalCluster(program, 2, 3, config=backups(1)) as cluster:

        def body(tr, t):
            while tr.step_count < 2 * STEPS:
                at = tr.step_count
                if t == 2:
                    slow_steps.append(at)
                    time.sleep(0.15)  # the straggler's slowness (what is tested), not a synchronisation
                step(tr, data[at][t])

        cluster.run_trainers(body, timeout=90)
        dropped = sum(s.servicer.counters.dropped_pushes for s in cluster.servers)
        with cluster.trainer(0) as tr:
            state = tr.state_dict()
    assert sorted(made) == list(range(2 * STEPS)) and all(len(m) == 2 for m in made.values())
    assert (
        dropped >= 2
    )  # the straggler was left out of some steps (each dropped push counts on both pservers)
    assert slow_steps == sorted(set(slow_steps)), "the straggler went back a step"
    expected = train_concatenated(program(), [[data[s][t] for t in made[s]] for s in sorted(made)])
    assert_equal_to(state, expected)


def transpile(sync_mode: bool = True, **config) -> None:
    t = DistributeTranspiler(DistributeTranspilerConfig(**config))
    t.transpile(0, program=program(), pservers="127.0.0.1:1,127.0.0.1:2", trainers=2, sync_mode=sync_mode)


@pytest.mark.parametrize(
    "case, sync_mode, config, refusal",
    [
        ("async", False, {}, "async trainers never wait for each other"),
        ("GEO", False, dict(k_steps=2), "does not combine with k_steps"),
        ("collective", True, dict(mode="collective"), "does not combine with k_steps, mode='collective'"),
        ("streamed pushes", True, dict(push_during_backward=True), "a step claims its place first"),
        ("no trainer left", True, dict(backup_trainers=2), "leaves no trainer to make a step"),
    ],
)
def test_what_backup_trainers_refuse_is_refused_at_transpile_time(case, sync_mode, config, refusal):
    with pytest.raises(ValueError, match=refusal):
        transpile(sync_mode, **{"backup_trainers": 1, **config})


def test_backup_trainers_combine_with_hot_standby():
    """The step sets replicate with the first shard (tests/replication/test_chaos.py kills its primary)."""
    transpile(
        backup_trainers=1,
        server_replicas=2,
        replica_endpoints="127.0.0.1:3,127.0.0.1:4",
        coordinator="http://127.0.0.1:2379",
    )


@pytest.mark.timeout(120)
def test_a_step_whose_whole_set_left_before_pushing_is_claimed_again_by_the_live_trainers():
    """b = 1 of 2: trainer 0 claims step 0 (its set: trainer 0 alone) and dies before pushing it (no Close;
    the pservers drop it after heartbeat_timeout). Trainer 1, dropped from step 0, waits; once trainer 0
    is dropped, its push is answered with the step unapplied, it claims the step again and is admitted
    alone: step 0 is made of trainer 1's batch, as one process fed that batch."""
    data = batches(2, 8, 1, dtype=torch.float64)
    config = DistributeTranspilerConfig(backup_trainers=1, heartbeat_interval=0.2, heartbeat_timeout=1.0)
    with LocalCluster(program, 2, 2, config=config) as cluster:
        dead = cluster.trainer(0)
        assert dead.channels[dead.program.pservers[0]].claim(0).admitted
        dead._heartbeat.stop()  # dies: no heartbeat, no push, no Close
        dead.stepper.close(None)
        with cluster.trainer(1) as tr:
            step(tr, data[0][1])
            assert tr.step_count == 1
            state = tr.state_dict()
        assert [s.engine.step for s in cluster.servers] == [1, 1]
        assert [s.servicer.counters.dropped_pushes for s in cluster.servers] == [1, 1]
    assert_equal_to(state, train_concatenated(program(), [[data[0][1]]]))
