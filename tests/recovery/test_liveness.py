"""Liveness rides on the calls that flow: no heartbeat in steady training, none missing while a trainer is
idle.

In-process clusters (real gRPC pservers on loopback, trainers in threads) with a 0.2 s
``heartbeat_interval`` and a 1 s ``heartbeat_timeout``: a trainer that pushes every step sends no
heartbeat; one stalled past the timeout (a data loader) heartbeats, the one parked in the sync barrier
waiting for it does not (the pserver holds its call), neither is dropped, and the job ends with the
single-process model; one that goes silent is dropped after the timeout, as before. The decisions
themselves are tested as tables in tests/trainer/test_heartbeat.py; real processes killed or SIGSTOPped
past the timeout in test_recovery.py and test_overlaps.py.
"""

from __future__ import annotations

import logging
import time
from typing import Dict

import pytest
import torch
from torch import nn

from harness.cluster import LocalCluster, in_threads
from harness.models import FLOAT64_EXACT, batches, odd_mlp, train_concatenated
from tests.pserver.test_metrics import scrape, value
from trainer import job_metrics
from transpiler import DistributeTranspilerConfig, Program

INTERVAL = 0.2
TIMEOUT = 1.0


def build() -> Program:
    # OddMLP's blocks land on both pservers: every step pushes to each.
    return Program(odd_mlp(dtype=torch.float64), "adam", lr=0.01, weight_decay=0.01)


def config(**overrides) -> DistributeTranspilerConfig:
    return DistributeTranspilerConfig(
        **{"heartbeat_interval": INTERVAL, "heartbeat_timeout": TIMEOUT, **overrides}
    )


def train_step(tr, batch) -> None:
    x, y = batch
    nn.functional.cross_entropy(tr.model(x), y).backward()
    tr.step()


def heartbeats_by_trainer(cluster) -> Dict[str, Dict[int, int]]:
    """Per pserver: the heartbeats it received from each trainer so far."""
    out = {}
    for ep, server in zip(cluster.endpoints, cluster.servers):
        counters = server.servicer.counters
        with counters.lock:
            out[ep] = dict(counters.heartbeats_by_trainer)
    return out


def drops(caplog) -> list:
    return [r.getMessage() for r in caplog.records if "dropped from the barrier" in r.getMessage()]


@pytest.mark.timeout(120)
def test_steady_sync_training_sends_no_heartbeat():
    """2 trainers x 2 pservers, sync, for at least 5 intervals of steps: 0 heartbeats (Stats' count).

    A heartbeat goes out only when a pserver heard nothing for an interval, i.e. when one step (compute and
    push-pull) takes that long: a 1 s interval here, against steps of 30-45 ms, so that a loaded 2-core
    machine's hiccups do not make one; the default interval is 2 s.
    """
    interval = 1.0
    steady_for = 5 * interval
    data = batches(2, 4, 1, seed=3, dtype=torch.float64)[0]
    stop_at = [10**9]  # the first step neither trainer trains: trainer 0 decides it (see body)
    counts = {}
    slowest = [0.0]
    with LocalCluster(
        build, 2, 2, config=config(heartbeat_interval=interval, heartbeat_timeout=30.0)
    ) as cluster:
        with cluster.trainer(0) as tr0, cluster.trainer(1) as tr1:

            def stats():
                return {ep: r.heartbeats for ep, r in tr0.channels.stats(10.0).items()}

            def body(tr, i):
                step = 0
                while step < stop_at[0]:
                    began = time.monotonic()
                    train_step(tr, data[i])
                    slowest[0] = max(slowest[0], time.monotonic() - began)
                    if i == 0 and step == 2:  # warmed up: the steady part starts
                        counts["before"], counts["started"] = stats(), time.monotonic()
                        slowest[0] = 0.0
                    elif (
                        i == 0 and "started" in counts and time.monotonic() - counts["started"] >= steady_for
                    ):
                        # Trainer 1 starts step + 2 only after this trainer pushed step + 1, so both see the
                        # limit before it: they end on the same step.
                        stop_at[0] = min(stop_at[0], step + 2)
                    step += 1
                if i == 0:
                    counts["after"], counts["steps"] = stats(), step
                return step

            steps = in_threads({0: lambda: body(tr0, 0), 1: lambda: body(tr1, 1)})
    assert steps[0] == steps[1] == counts["steps"]
    sent = {ep: counts["after"][ep] - counts["before"][ep] for ep in cluster.endpoints}
    assert sent == {ep: 0 for ep in cluster.endpoints}, (
        f"heartbeats in steady training: {sent} over {counts['steps'] - 3} steps (slowest step "
        f"{slowest[0]:.3f}s, "
        f"interval {interval}s)"
    )


@pytest.mark.timeout(120)
def test_a_stalled_trainer_heartbeats_the_one_parked_waiting_for_it_does_not_and_neither_is_dropped(caplog):
    """Trainer 1's data stalls 1.5 s (> heartbeat_timeout) before step 2; trainer 0 waits in the barrier
    meanwhile."""
    caplog.set_level(logging.INFO)
    stall, stall_before = 1.5 * TIMEOUT, 2
    data = batches(2, 4, 4, seed=5, dtype=torch.float64)
    during = {}
    with LocalCluster(build, 2, 2, config=config(metrics_port=0)) as cluster:

        def body(tr, i):
            for step, step_batches in enumerate(data):
                if i == 1 and step == stall_before:
                    before = heartbeats_by_trainer(cluster)
                    # The data loader stalls: this sleep is the behaviour under test, not a synchronisation.
                    time.sleep(stall)
                    after = heartbeats_by_trainer(cluster)
                    during.update(
                        {ep: {t: after[ep].get(t, 0) - before[ep].get(t, 0) for t in (0, 1)} for ep in after}
                    )
                train_step(tr, step_batches[i])
            return tr.state_dict()

        states = cluster.run_trainers(body)
        stats = [server.engine.stats() for server in cluster.servers]
        metrics = [scrape(server.metrics_port) for server in cluster.servers]
        received = heartbeats_by_trainer(cluster)
    assert not drops(caplog)
    for s in stats:
        assert s.dropped == () and s.step == len(data)
    # Both pservers heard heartbeats from the stalled trainer (no call at all) during the stall, and none from
    # the one whose push of step 2 was parked there the whole time: a parked call is no silence to them.
    for ep, samples in zip(cluster.endpoints, metrics):
        assert during[ep][0] == 0 and during[ep][1] >= 1, during
        # What operators see of it: /metrics (ps-stat's HEARTBEATS column reads the same counter).
        assert value(samples, "ps_heartbeats_total") == sum(received[ep].values())
        assert value(samples, "ps_trainer_heartbeats_total", trainer="1") == received[ep][1] >= during[ep][1]
        # Trainer 0 never heartbeated this pserver: no series (a counter appears with its first heartbeat).
        assert (
            received[ep].get(0, 0) == 0
            and ("ps_trainer_heartbeats_total", frozenset({("trainer", "0")})) not in samples
        )
    expected = train_concatenated(build(), data)
    for i in (0, 1):
        assert states[i].keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(states[i][name], expected[name], **FLOAT64_EXACT)


@pytest.mark.timeout(120)
def test_a_trainer_waiting_in_a_reduce_round_past_heartbeat_timeout_is_not_dropped(caplog):
    """Trainer 1 comes to the round 1.5 s (> heartbeat_timeout) after trainer 0, whose Reduce the pserver
    holds."""
    caplog.set_level(logging.INFO)
    with LocalCluster(build, 2, 2, config=config()) as cluster:
        server = cluster.servers[0]  # the pserver reductions go through
        with cluster.trainer(0) as tr0, cluster.trainer(1) as tr1:
            seen = {}

            def late():
                deadline = time.monotonic() + 30
                while server.reductions.parked_trainers() != {0}:
                    assert time.monotonic() < deadline, "trainer 0's Reduce never parked"
                    time.sleep(0.005)
                # Trainer 1's evaluation takes long: this sleep is the behaviour under test, not a
                # synchronisation.
                time.sleep(1.5 * TIMEOUT)
                seen["held"] = server.engine.presence(0)[0] - time.monotonic()
                seen["before_release"] = time.monotonic()
                return job_metrics.all_reduce(tr1, "loss", {"v": 2.0})

            out = in_threads({0: lambda: job_metrics.all_reduce(tr0, "loss", {"v": 1.0}), 1: late})
            heard, ended = server.engine.presence(0)
            heartbeats = heartbeats_by_trainer(cluster)[cluster.endpoints[0]].get(0, 0)
    assert out[0]["v"].tolist() == out[1]["v"].tolist() == 3.0
    assert not drops(caplog) and not ended
    assert seen["held"] > -0.5  # alive to a takeover while its round holds it
    assert heard >= seen["before_release"]  # heard from when the round released it
    assert heartbeats == 0  # its call in flight was contact: no heartbeat needed


def die(tr) -> None:
    """What a trainer process that dies leaves behind: no call any more (heartbeats included), no Close."""
    tr._heartbeat.stop()
    tr.stepper.close(None)  # its connections closed without telling the pservers


@pytest.mark.timeout(120)
def test_a_trainer_that_goes_silent_is_still_dropped_after_heartbeat_timeout(caplog):
    caplog.set_level(logging.INFO)
    data = batches(2, 4, 3, seed=9, dtype=torch.float64)
    with LocalCluster(build, 2, 2, config=config()) as cluster:
        with cluster.trainer(0) as tr0:
            tr1 = cluster.trainer(1)
            in_threads({i: (lambda i=i: train_step((tr0, tr1)[i], data[0][i])) for i in (0, 1)})
            die(tr1)
            silent_since = time.monotonic()
            train_step(tr0, data[1][0])  # parked until both pservers drop trainer 1, then applied without it
            waited = time.monotonic() - silent_since
            stats = [server.engine.stats() for server in cluster.servers]
            train_step(tr0, data[2][0])  # alone from now on
    # Dropped after heartbeat_timeout of silence (less what passed between its last call and its death),
    # long before the barrier_timeout; trainer 0, parked as long, was not.
    assert TIMEOUT - INTERVAL <= waited < TIMEOUT + 10.0
    for s in stats:
        assert s.dropped == (1,) and s.alive == (0,) and s.step == 2
    assert len(drops(caplog)) == 2 and all("trainer 1 " in d for d in drops(caplog))
