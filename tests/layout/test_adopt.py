"""Trainers that adopt a new layout mid-training: a sync job with distributed tables goes from 2 to 3 to 2
pservers, the pservers restarted at each change from a checkpoint of the step they stopped at, the trainers
staying up and adopting the next plan; the model equals one process on the same batches (float64)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from harness.cluster import LocalCluster
from harness.ports import free_ports
from pserver import ParameterServer
from tests.helpers.table_models import (
    BAG_VOCAB,
    VOCAB,
    counting_program,
    single_process,
    table_batches,
    table_program,
)
from tests.tables.test_sync import assert_matches
from trainer.layout_changes import applied_before_the_switch
from transpiler import DistributeTranspilerConfig
from transpiler.layout.change import next_pserver_program, next_trainer_program

STEPS = 10


def change_pservers(cluster: LocalCluster, endpoints) -> None:
    """Stop every pserver and start ``endpoints`` with the next plan; they resume from the checkpoint
    written at the step the job stands at."""
    now = cluster.servers[0].program
    for server in cluster.servers:
        server.stop()
    cluster.servers = [
        cluster._stack.enter_context(
            ParameterServer(next_pserver_program(now, endpoints, ep), None, security=cluster.security)
        )
        for ep in endpoints
    ]
    cluster.endpoints = list(endpoints)


def change_between_steps(cluster: LocalCluster, tr, i: int, between: threading.Barrier, endpoints) -> None:
    """Every trainer between two steps: trainer 0 has every pserver write its part and the pservers
    changed to ``endpoints``; the trainers then go on together (each adopts the next plan)."""
    between.wait(30)
    if i == 0:
        tr.checkpoint()
        change_pservers(cluster, endpoints)
    between.wait(30)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("loop", ["plain", "batches with prefetch"])
def test_a_sync_job_goes_from_2_to_3_to_2_pservers_with_its_trainers_up_and_equals_one_process(
    tmp_path, loop
):
    """``batches with prefetch``: the feed has read the next batch and routed its ids to the old pservers
    when the layout changes; that plan is dropped and the data position goes on."""
    data = table_batches(2, 4, STEPS, seed=7)
    build = lambda: table_program("adagrad", torch.float64)  # noqa: E731
    config = DistributeTranspilerConfig(checkpoint_dir=str(tmp_path / "checkpoints"))
    with LocalCluster(build, 2, 2, config=config) as cluster:
        grown = cluster.endpoints + [f"127.0.0.1:{p}" for p in free_ports(1)]
        changes = {3: grown, 7: grown[:2]}
        between = threading.Barrier(2)
        epochs, steps_seen, rows = {0: [], 1: []}, {0: [], 1: []}, []

        def body(tr, i):
            mine = [step_batches[i] for step_batches in data]
            items = (
                iter(mine)
                if loop == "plain"
                else tr.batches(mine, 1, prefetch=lambda b: {"emb": b[0], "bag": b[1]})
            )
            for ids, bag, y in items:
                nn.functional.cross_entropy(tr.model(ids, bag), y).backward()
                step = tr.step()
                steps_seen[i].append(step)
                if i == 0 and step == 5:  # the grown layout: every pserver holds table rows
                    rows.append([s.engine.tables.rows for s in cluster.servers])
                if step in changes:
                    change_between_steps(cluster, tr, i, between, changes[step])
                    with pytest.raises(ValueError, match="must be a later layout of this job"):
                        tr.adopt(tr.program)  # refused, nothing changed
                    tr.adopt(next_trainer_program(tr.program, changes[step]))
                    epochs[i].append((tr.program.layout_epoch, len(tr.program.pservers), tr.step_count))
            if loop != "plain":
                assert tr.position == (1, 0)  # the epoch ran to its end
            return (
                tr.state_dict(),
                {
                    "emb": tr.pull_rows("emb", torch.from_numpy(VOCAB)),
                    "bag": tr.pull_rows("bag", torch.from_numpy(BAG_VOCAB)),
                },
            )

        results = cluster.run_trainers(body, timeout=100)
        assert len(rows[0]) == 3 and min(rows[0]) > 0
        assert [s.engine.step for s in cluster.servers] == [STEPS, STEPS]
    expected = single_process(build(), data)
    for i in (0, 1):
        assert_matches(results[i], expected)
        assert epochs[i] == [(1, 3, 3), (2, 2, 7)]
        assert steps_seen[i] == list(range(1, STEPS + 1))  # no step repeated, none rolled back


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "config, sync_mode, message",
    [
        (dict(k_steps=2), False, "not supported with GeoStepper yet"),
        (dict(backup_trainers=1), True, "not supported with LocalStepper and backup trainers yet"),
    ],
)
def test_a_trainer_that_cannot_change_layout_yet_refuses_and_goes_on(config, sync_mode, message):
    build = lambda: table_program("sgd")  # noqa: E731
    with LocalCluster(build, 1, 2, sync_mode, DistributeTranspilerConfig(**config)) as cluster:
        grown = cluster.endpoints + [f"127.0.0.1:{p}" for p in free_ports(1)]
        with cluster.trainer(0) as tr:
            before = tr.program
            with pytest.raises(ValueError, match=message):
                tr.adopt(next_trainer_program(tr.program, grown))
            assert tr.program is before and tr.channels.endpoints == cluster.endpoints


@pytest.mark.timeout(120)
def test_an_async_job_applies_every_acknowledged_push_once_across_two_changes(tmp_path):
    build = counting_program
    config = DistributeTranspilerConfig(checkpoint_dir=str(tmp_path / "checkpoints"))
    batches = torch.from_numpy(
        VOCAB[torch.randint(0, len(VOCAB), (2, STEPS, 6), generator=torch.Generator().manual_seed(3)).numpy()]
    )
    with LocalCluster(build, 2, 2, sync_mode=False, config=config) as cluster:
        bias0 = float(build().model.count.bias.detach())
        grown = cluster.endpoints + [f"127.0.0.1:{p}" for p in free_ports(1)]
        changes = {3: grown, 7: grown[:2]}
        between = threading.Barrier(2)

        def body(tr, i):
            for ids in batches[i]:
                tr.model(ids).backward()
                step = tr.step()
                if step in changes:
                    change_between_steps(cluster, tr, i, between, changes[step])
                    tr.adopt(next_trainer_program(tr.program, changes[step]))
            between.wait(30)  # every push of both trainers acknowledged
            return float(tr.state_dict()["count.bias"]), tr.pull_rows("emb", torch.from_numpy(VOCAB))

        results = cluster.run_trainers(body, timeout=100)
    counts = torch.bincount(
        torch.searchsorted(torch.from_numpy(VOCAB), batches.reshape(-1)), minlength=len(VOCAB)
    ).to(torch.float64)
    for bias, rows in results.values():
        assert bias == bias0 - 2 * STEPS  # every push's bias gradient applied once
        assert torch.equal(rows, -counts[:, None].expand(-1, 2))  # every looked-up row, once per lookup


@pytest.mark.parametrize(
    "pushed, joined, applied",
    [
        (26, 26, False),  # refused after the switch: pushed again in the next layout
        (26, 27, True),  # applied, its pserver lost before it answered: the next layout starts past it
        (0, 0, False),
    ],
)
def test_a_step_answered_moved_is_pushed_again_unless_the_next_layout_starts_past_it(pushed, joined, applied):
    assert applied_before_the_switch(pushed, joined) is applied


@pytest.mark.timeout(60)
def test_a_trainer_heartbeats_the_next_layout_while_its_join_waits_for_a_late_pserver(tmp_path, caplog):
    """A pserver of the next layout may come up later than heartbeat_timeout (restarted right after the
    commit on a loaded host: the chaos test, victim "old owner"). The adopting trainer's join said Hello to
    the others and waits for it: heartbeating them meanwhile, it is not dropped for silence (dropped, the
    others would complete the layout's first step without it, and it would skip it)."""
    config = DistributeTranspilerConfig(
        checkpoint_dir=str(tmp_path / "checkpoints"), heartbeat_interval=0.2, heartbeat_timeout=1.0
    )
    with LocalCluster(counting_program, 1, 1, config=config) as cluster:
        grown = cluster.endpoints + [f"127.0.0.1:{p}" for p in free_ports(1)]
        with cluster.trainer(0) as tr:
            tr.checkpoint()
            now = cluster.servers[0].program
            cluster.servers[0].stop()

            def start(ep: str) -> None:
                server = ParameterServer(
                    next_pserver_program(now, grown, ep), None, security=cluster.security
                )
                cluster.servers.append(cluster._stack.enter_context(server))

            start(grown[0])
            late = threading.Timer(3.0, start, [grown[1]])  # three heartbeat_timeouts after the first
            late.start()
            tr.adopt(next_trainer_program(tr.program, grown))
            late.join()
            assert tr.channels.endpoints == grown
    assert "sent nothing" not in caplog.text
