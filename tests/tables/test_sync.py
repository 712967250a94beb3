"""Distributed tables train exactly like single-process torch with nn.Embedding(sparse=True).

2 pservers x 2 trainers, sync: after k steps the pulled rows and the dense
parameters equal one process on the concatenated batch, for SGD, Adagrad
and SparseAdam on the tables. Async with one trainer is the same sequence of
updates, so it must match too.
"""

import threading

import pytest
import torch
from torch import nn

from harness.cluster import LocalCluster
from harness.models import FLOAT64_EXACT
from tests.helpers.table_models import BAG_VOCAB, VOCAB, single_process, table_batches, table_program
from transpiler import DistributeTranspilerConfig

STEPS = 4
PER_TRAINER = 8

CASES = {
    # dense optimizer kwargs; the table optimizer is derived (sgd->sgd, adagrad->adagrad, adam->SparseAdam)
    "sgd": dict(lr=0.5),
    "adagrad": dict(lr=0.3, lr_decay=0.01, initial_accumulator_value=0.1),
    "adam": dict(
        lr=0.05, weight_decay=0.01, lr_scheduler="StepLR", lr_scheduler_kwargs={"step_size": 2, "gamma": 0.5}
    ),
}


def train(cluster, data):
    def body(tr, i):
        for step_batches in data:
            ids, bag, y = step_batches[i]
            nn.functional.cross_entropy(tr.model(ids, bag), y).backward()
            tr.step()
        return (
            tr.state_dict(),
            {
                "emb": tr.pull_rows("emb", torch.from_numpy(VOCAB)),
                "bag": tr.pull_rows("bag", torch.from_numpy(BAG_VOCAB)),
            },
        )

    return cluster.run_trainers(body)


def assert_matches(result, expected):
    """float32: to 1e-5, safe on any CPU: at most 14 steps of a 22-feature model, whose sums are a few
    terms long; the largest gap seen (12 Adagrad steps) used 0.12 of the bound with ATen's and MKL's AVX2
    kernels, 0.07 with their non-vectorized ones, the others 0.09 at most."""
    (state, rows), (ref_state, ref_rows) = result, expected
    assert state.keys() == ref_state.keys()
    tolerance = (
        FLOAT64_EXACT if ref_state["head.weight"].dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    )
    for name in ref_state:
        torch.testing.assert_close(state[name], ref_state[name], **tolerance, msg=lambda m: f"{name}: {m}")
    for name in ref_rows:
        torch.testing.assert_close(
            rows[name], ref_rows[name], **tolerance, msg=lambda m: f"table {name}: {m}"
        )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("optimizer", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sync_tables_match_single_process(optimizer, dtype):
    data = table_batches(2, PER_TRAINER, STEPS)
    build = lambda: table_program(optimizer, dtype, **CASES[optimizer])  # noqa: E731
    with LocalCluster(build, 2, 2) as cluster:
        results = train(cluster, data)
        assert all(s.engine.tables.rows > 0 for s in cluster.servers)  # both shards hold rows
    expected = single_process(build(), data)
    for i in (0, 1):
        assert_matches(results[i], expected)
    # Training really moved the rows that were looked up (a no-op would match a no-op).
    initial = table_program(optimizer, dtype).tables[0]
    from transpiler.tables import initial_rows

    start = torch.from_numpy(initial_rows(initial, VOCAB))
    moved = (results[0][1]["emb"] - start).abs().amax(dim=1) > 1e-4
    assert 0 < int(moved.sum()) < len(VOCAB)  # some ids were never drawn: those rows stay put


@pytest.mark.timeout(60)
def test_table_optimizer_can_differ_from_dense():
    """Dense momentum SGD, tables trained by Adagrad and SparseAdam given per table."""
    tables = {
        "emb": {"optimizer": "adagrad", "optimizer_kwargs": {"lr": 0.2}},
        "bag": {
            "optimizer": "adam",
            "optimizer_kwargs": {"lr": 0.03, "betas": (0.8, 0.9)},
            "init": "uniform",
            "init_kwargs": {"a": -0.5, "b": 0.5},
        },
    }
    data = table_batches(2, PER_TRAINER, STEPS, seed=9)
    build = lambda: table_program("momentum", tables=tables, lr=0.1)  # noqa: E731
    with LocalCluster(build, 3, 2) as cluster:
        results = train(cluster, data)
    expected = single_process(build(), data)
    for i in (0, 1):
        assert_matches(results[i], expected)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])
def test_async_single_trainer_matches_single_process(optimizer):
    """Without the async pipeline (the default), each step waits for its own push: one trainer
    is one process."""
    data = table_batches(1, 2 * PER_TRAINER, STEPS, seed=4)
    build = lambda: table_program(optimizer, **CASES[optimizer])  # noqa: E731
    with LocalCluster(build, 2, 1, sync_mode=False) as cluster:
        results = train(cluster, data)
    assert_matches(results[0], single_process(build(), data))


def count_prefetches(tr) -> list:
    """The endpoint of every Prefetch ``tr`` sends from now on, in a list that grows as they go."""
    calls = []
    for ep in tr.program.pservers:
        channel = tr.channels[ep]
        channel.prefetch = lambda *a, ep=ep, send=channel.prefetch: calls.append(ep) or send(*a)
    return calls


@pytest.mark.timeout(60)
def test_explicit_prefetch_serves_lookups_in_one_round_trip():
    """tr.prefetch() fetches every table at once; the step's lookups then ask the pservers nothing."""
    data = table_batches(2, PER_TRAINER, STEPS, seed=2)
    build = lambda: table_program("sgd", lr=0.5)  # noqa: E731
    with LocalCluster(build, 2, 2) as cluster:

        def body(tr, i):
            calls = count_prefetches(tr)
            for step_batches in data:
                ids, bag, y = step_batches[i]
                tr.prefetch({"emb": ids, "bag": bag})
                assert sorted(calls) == sorted(cluster.endpoints)  # one round trip per pserver
                nn.functional.cross_entropy(tr.model(ids, bag), y).backward()
                assert len(calls) == 2  # the lookups asked nothing more
                calls.clear()
                tr.step()
            return (
                tr.state_dict(),
                {
                    "emb": tr.pull_rows("emb", torch.from_numpy(VOCAB)),
                    "bag": tr.pull_rows("bag", torch.from_numpy(BAG_VOCAB)),
                },
            )

        results = cluster.run_trainers(body)
    expected = single_process(build(), data)
    for i in (0, 1):
        assert_matches(results[i], expected)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sync_mode", [True, False])
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_next_batch_ids_ride_with_the_push_and_save_every_later_lookup_round_trip(optimizer, sync_mode):
    """tr.batches(prefetch=...) sends each next batch's ids with the step's push; the answer brings
    their rows as of after the step, so only the first batch's lookups call Prefetch, and the model
    still equals single-process training (sync; async with one trainer is the same sequence)."""
    n_trainers = 2 if sync_mode else 1
    data = table_batches(n_trainers, PER_TRAINER, STEPS, seed=11)
    build = lambda: table_program(optimizer, **CASES[optimizer])  # noqa: E731
    with LocalCluster(build, 2, n_trainers, sync_mode=sync_mode) as cluster:

        def body(tr, i):
            calls = count_prefetches(tr)
            mine = [step_batches[i] for step_batches in data]
            for ids, bag, y in tr.batches(mine, 1, prefetch=lambda b: {"emb": b[0], "bag": b[1]}):
                tr.prefetch({"emb": ids, "bag": bag})  # a no-op once the rows came with the last answer
                nn.functional.cross_entropy(tr.model(ids, bag), y).backward()
                tr.step()
            assert sorted(calls) == sorted(cluster.endpoints)  # the first batch's one round trip per pserver
            return (
                tr.state_dict(),
                {
                    "emb": tr.pull_rows("emb", torch.from_numpy(VOCAB)),
                    "bag": tr.pull_rows("bag", torch.from_numpy(BAG_VOCAB)),
                },
            )

        results = cluster.run_trainers(body)
    expected = single_process(build(), data)
    for i in range(n_trainers):
        assert_matches(results[i], expected)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("read_ahead", [True, False])
def test_reading_ahead_prepares_the_next_ids_on_the_feed_thread_and_trains_exactly_the_same(read_ahead):
    """With read_ahead the loader's next item is read, and its ids deduplicated and routed, on the
    feed thread while the current one trains; the step sends that plan. Sync training still equals
    single-process torch, as it does with read_ahead off (everything on the training thread)."""
    data = table_batches(2, PER_TRAINER, STEPS, seed=13)
    build = lambda: table_program("adagrad", **CASES["adagrad"])  # noqa: E731
    config = DistributeTranspilerConfig(read_ahead=read_ahead)
    with LocalCluster(build, 2, 2, config=config) as cluster:

        def body(tr, i):
            planned_on = []
            plan = tr.tables.plan_next_batch
            tr.tables.plan_next_batch = lambda *a: (
                planned_on.append(threading.current_thread().name) or plan(*a)
            )
            mine = [step_batches[i] for step_batches in data]
            for ids, bag, y in tr.batches(mine, 1, prefetch=lambda b: {"emb": b[0], "bag": b[1]}):
                nn.functional.cross_entropy(tr.model(ids, bag), y).backward()
                tr.step()
            assert len(planned_on) == STEPS - 1  # every batch after the first
            on_feed = {name.startswith("trainer-feed") for name in planned_on}
            assert on_feed == {read_ahead}
            return (
                tr.state_dict(),
                {
                    "emb": tr.pull_rows("emb", torch.from_numpy(VOCAB)),
                    "bag": tr.pull_rows("bag", torch.from_numpy(BAG_VOCAB)),
                },
            )

        results = cluster.run_trainers(body)
    expected = single_process(build(), data)
    for i in (0, 1):
        assert_matches(results[i], expected)
