"""Trainer nodes of several local processes (one per GPU in production; gloo on CPU here).

2 nodes x 2 local processes against 2 pservers, sync: the parameters after k
steps equal single-process training on the concatenated batches of all four
processes; the pservers count 2 trainers, and each node pushed each block
exactly once per step. The same with distributed tables whose ids overlap
across local ranks (SGD and Adagrad).
"""

import multiprocessing
import signal

import pytest
import torch

from harness.cluster import LocalCluster
from harness.models import FLOAT64_EXACT, assert_state_close, batches, odd_mlp, train_concatenated
from harness.ports import free_ports
from tests.helpers.nodes import exchange_process, run_nodes, start_node, stop, wait_all
from tests.helpers.table_models import BAG_VOCAB, VOCAB, single_process, table_batches, table_model
from transpiler import DistributeTranspilerConfig, Program, TableOptions

STEPS = 3
PER_PROCESS = 6


def dense_program() -> Program:
    return Program(odd_mlp(dtype=torch.float32), "momentum", lr=0.05, momentum=0.9)


def table_program() -> Program:
    """One table trained with SGD, the other with Adagrad: both sparse updates in one job."""
    return Program(
        table_model(torch.float64),
        "sgd",
        lr=0.5,
        distributed_tables={
            "emb": TableOptions(optimizer="sgd", optimizer_kwargs=dict(lr=0.5)),
            "bag": TableOptions(
                optimizer="adagrad", optimizer_kwargs=dict(lr=0.3, initial_accumulator_value=0.1)
            ),
        },
    )


@pytest.mark.timeout(120)
def test_two_nodes_of_two_processes_train_as_one_process(tmp_path):
    build = dense_program
    data = batches(4, PER_PROCESS, STEPS)
    config = DistributeTranspilerConfig()
    with LocalCluster(build, 2, 2, config=config) as cluster:
        results = run_nodes(tmp_path, build, cluster.endpoints, data, config=config)
        counters = [s.servicer.counters for s in cluster.servers]
        blocks = [len(list(s.engine.store.names())) for s in cluster.servers]
        seen = [sorted(s.engine.roster.last_step) for s in cluster.servers]
    expected = train_concatenated(build(), data)
    for state, _, steps in results:
        assert steps == STEPS
        assert_state_close(state, expected, atol=1e-5)  # 4 float32 momentum steps: 0.0015 of it used
    for c, n_blocks, trainers in zip(counters, blocks, seen):
        assert trainers == [0, 1]  # the pservers saw two trainers: the nodes
        assert c.pushes_by_trainer == {0: STEPS, 1: STEPS}  # one push per node per step
        assert c.blocks_by_trainer == {0: STEPS * n_blocks, 1: STEPS * n_blocks}  # each block once per step


@pytest.mark.timeout(120)
def test_nodes_with_distributed_tables_train_as_one_process(tmp_path):
    build = table_program
    data = table_batches(4, PER_PROCESS, STEPS)  # zipf ids: local ranks of a node share ids
    overlap = set(data[0][0][0].flatten().tolist()) & set(data[0][1][0].flatten().tolist())
    assert overlap, "the data must make local ranks look up the same ids"
    with LocalCluster(build, 2, 2) as cluster:
        results = run_nodes(
            tmp_path, build, cluster.endpoints, data, tables=[("emb", VOCAB), ("bag", BAG_VOCAB)]
        )
        pushes = [s.servicer.counters.pushes_by_trainer for s in cluster.servers]
    ref_state, ref_rows = single_process(build(), data)
    for state, rows, steps in results:  # float64 (table_program): to rounding, 7e-16 seen
        assert steps == STEPS and state.keys() == ref_state.keys()
        for name in ref_state:
            torch.testing.assert_close(state[name], ref_state[name], **FLOAT64_EXACT, msg=name)
        for name in ref_rows:
            torch.testing.assert_close(rows[name], ref_rows[name], **FLOAT64_EXACT, msg=name)
    assert pushes == [{0: STEPS, 1: STEPS}] * 2


@pytest.mark.timeout(150)
def test_a_killed_local_rank_fails_its_node_fast_and_the_restarted_node_rejoins(tmp_path):
    """SIGKILL node 1's local rank 1 before step 2: its rank 0 fails within seconds naming itself and
    the node, without closing the trainer id; node 1 restarted whole rejoins, and every process ends."""
    build = dense_program
    data = batches(4, PER_PROCESS, 5)
    config = DistributeTranspilerConfig(heartbeat_interval=0.5, heartbeat_timeout=60)
    ctx = multiprocessing.get_context("spawn")
    ports = free_ports(2)
    with LocalCluster(build, 2, 2, config=config) as cluster:
        node0 = start_node(ctx, build, cluster.endpoints, 0, 2, 2, ports[0], data, tmp_path, config)
        node1 = start_node(
            ctx, build, cluster.endpoints, 1, 2, 2, ports[1], data, tmp_path, config, kill=(1, 2)
        )
        restarted = []
        try:
            codes = wait_all([p for p, _ in node1])
            assert codes[1] == -signal.SIGKILL and codes[0] not in (0, None), codes
            with open(node1[1][1] + ".killed") as f:
                killed_at = float(f.read())
            with open(node1[0][1] + ".error") as f:
                failed_at, error = float(f.readline()), f.read()
            # The promise (NodeGroup): a dead local rank fails the others' collectives at once on gloo, not
            # after the node group's timeout (the Trainer's: max(barrier, recovery) + rpc timeout), which is
            # how long rank 0 would otherwise wait for it. Halfway between the two; it failed after the kill.
            group_timeout = max(config.barrier_timeout, config.recovery_timeout) + config.rpc_timeout
            assert 0 <= failed_at - killed_at < group_timeout / 2, (
                f"the node's rank 0 took {failed_at - killed_at:.1f}s to fail"
            )
            assert error.startswith("NodeError: trainer node 1, local rank 0:"), error
            assert "restart all its processes" in error
            assert all(
                1 not in s.engine.roster.closed for s in cluster.servers
            )  # a failed node does not Close

            restarted = start_node(
                ctx, build, cluster.endpoints, 1, 2, 2, ports[1], data, tmp_path, config, tag="-restarted"
            )
            codes = wait_all([p for p, _ in node0 + restarted])
            assert codes == [0, 0, 0, 0], codes
            seen = [sorted(s.engine.roster.last_step) for s in cluster.servers]
        finally:
            stop([p for p, _ in node0 + node1 + restarted])
    assert seen == [[0, 1], [0, 1]]
    for node in (node0, restarted):  # the local ranks of a node end with the same model
        (a, _, steps_a), (b, _, steps_b) = [torch.load(out, weights_only=False) for _, out in node]
        assert steps_a == steps_b
        assert_state_close(a, b, atol=0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("exchange", ["scatter", "all_reduce"])
def test_the_node_exchanges_give_each_rank_its_mean_share_and_everyone_every_block(tmp_path, exchange):
    """Both collective schemes (NCCL's default reduce-scatter + all-gather, gloo's all-reduce) on gloo:
    each rank gets the mean gradient of its pservers' blocks only; a gather installs every block on
    every rank; a gather in which one rank failed installs nothing and says so on both."""
    data = [b for b in batches(2, 5, 1)[0]]
    ctx = multiprocessing.get_context("spawn")
    (port,) = free_ports(1)
    outs = [str(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    procs = [ctx.Process(target=exchange_process, args=(exchange, r, port, data, outs[r])) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        assert wait_all(procs, 50) == [0, 0]
    finally:
        stop(procs)
    got = [torch.load(o, weights_only=False) for o in outs]
    assert got[0]["endpoints"] == ["127.0.0.1:1", "127.0.0.1:3"] and got[1]["endpoints"] == ["127.0.0.1:2"]
    shares = [set(g["share"]) for g in got]
    assert shares[0] and shares[1] and not shares[0] & shares[1]  # every block reduced to exactly one rank
    names = sorted(got[0]["installed"])
    assert shares[0] | shares[1] == set(names)
    for g in got:
        assert not g["failed"] and g["worst"] == 0 and g["failed_gather"] == 1
        for name, t in g["share"].items():
            torch.testing.assert_close(t, g["expected"][name], rtol=0, atol=1e-6)
        for i, name in enumerate(names):
            assert bool((g["installed"][name] == i + 0.5).all()), name
            assert bool((g["after_failed"][name] == i + 0.5).all()), name  # the failed gather left them
