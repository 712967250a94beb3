"""Async pipeline: step() sends in the background; pulled parameters are installed at the next step.

With one trainer the schedule is exact: the gradient of step s is computed on
the parameters installed at step s-1, which hold the updates of steps up to
s-2, so the pserver computes theta[s+1] = theta[s] - lr * grad(theta[s-1]).
"""

import math
import threading

import pytest
import torch
from torch import nn

from harness.cluster import LocalCluster
from harness.models import FLOAT64_EXACT, batches, odd_mlp
from tests.helpers.table_models import (
    BAG_VOCAB,
    VOCAB,
    local_tables,
    positions,
    table_batches,
    table_program,
)
from trainer import PserverError
from trainer.steppers.pipelined import PipelinedStepper
from transpiler import DistributeTranspilerConfig, Program

LR = 0.1
PIPELINED = DistributeTranspilerConfig(async_pipeline=True)


def program():
    return Program(odd_mlp(dtype=torch.float64), "sgd", lr=LR)


def delayed(model: nn.Module, lrs, losses) -> dict:
    """Single-process reference of the pipelined schedule (sgd, ``lrs`` by parameter name): each of
    ``losses`` (callables) is differentiated on the parameters of the step before and applied to the
    current ones; the final parameters by name."""
    params = dict(model.named_parameters())
    server = {n: p.detach().clone() for n, p in params.items()}  # theta[s]
    for loss in losses:
        model.zero_grad()
        loss().backward()  # on the installed parameters
        installed = {n: t.clone() for n, t in server.items()}  # what step s+1 computes on
        for n, p in params.items():
            server[n] -= lrs[n] * (p.grad.to_dense() if p.grad.is_sparse else p.grad)
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(installed[n])
    return server


def delayed_sgd(data, steps):
    """The pipelined schedule of :func:`program` on ``data``'s first ``steps`` batches."""
    model = odd_mlp(dtype=torch.float64)
    lrs = {n: LR for n, _ in model.named_parameters()}
    losses = [lambda b=data[s][0]: nn.functional.cross_entropy(model(b[0]), b[1]) for s in range(steps)]
    return delayed(model, lrs, losses)


@pytest.mark.timeout(60)
def test_pipelined_async_steps_are_one_step_stale_and_exact():
    steps = 5
    data = batches(1, 16, steps, dtype=torch.float64)
    with LocalCluster(program, 2, 1, sync_mode=False, config=PIPELINED) as cluster:
        with cluster.trainer(0) as tr:
            assert isinstance(tr.stepper, PipelinedStepper)
            for s in range(steps):
                x, y = data[s][0]
                nn.functional.cross_entropy(tr.model(x), y).backward()
                assert tr.step() == s + 1
                assert all(p.grad is None for p in tr.model.parameters())  # the step dropped them
            state = tr.state_dict()  # waits for the last push, then pulls
    expected = delayed_sgd(data, steps)
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")
    # Not the plain (unpipelined) schedule: staleness really is one step.
    plain = odd_mlp(dtype=torch.float64)
    opt = torch.optim.SGD(plain.parameters(), lr=LR)
    for s in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(plain(data[s][0][0]), data[s][0][1]).backward()
        opt.step()
    assert not torch.allclose(state["fc2.weight"], plain.fc2.weight.detach())


@pytest.mark.timeout(60)
def test_pipeline_off_by_default_waits_for_each_push():
    data = batches(1, 16, 3, dtype=torch.float64)
    with LocalCluster(program, 2, 1, sync_mode=False) as cluster:
        with cluster.trainer(0) as tr:
            assert not isinstance(tr.stepper, PipelinedStepper)
            for s in range(3):
                x, y = data[s][0]
                nn.functional.cross_entropy(tr.model(x), y).backward()
                tr.step()
                assert all(srv.engine.step == s + 1 for srv in cluster.servers)
                assert all(p.grad is None for p in tr.model.parameters())  # the step dropped them


@pytest.mark.timeout(60)
def test_a_refused_background_push_surfaces_at_the_next_step():
    with LocalCluster(program, 1, 1, sync_mode=False, config=PIPELINED) as cluster:
        tr = cluster.trainer(0)
        try:
            x, y = batches(1, 8, 1, dtype=torch.float64)[0][0]
            nn.functional.cross_entropy(tr.model(x), y).backward()
            tr.model.fc1.weight.grad[0, 0] = math.nan
            tr.step()  # returns: the push is in flight
            nn.functional.cross_entropy(tr.model(x), y).backward()
            with pytest.raises(PserverError, match="NaN or Inf"):
                tr.step()
            assert cluster.servers[0].engine.step == 0  # refused, nothing applied
        finally:
            tr.close()


def test_pipelined_lookups_use_rows_fetched_on_the_feed_thread_while_the_last_batch_trained():
    """Async pipeline + read_ahead: while batch s trains, the feed thread reads batch s+1 and fetches
    its rows, so after the first batch no lookup waits for a Prefetch of its own; training moves them
    (how stale they are: the next test)."""
    data = table_batches(1, 16, 6, seed=3)
    with LocalCluster(
        lambda: table_program("sgd", lr=0.5), 2, 1, sync_mode=False, config=PIPELINED
    ) as cluster:

        def body(tr, _):
            fetched_by_lookups, planned = [], []
            fetch, plan = tr.tables.fetch, tr.tables.plan_next_batch
            tr.tables.fetch = lambda wanted: fetched_by_lookups.append(sorted(wanted)) or fetch(wanted)

            def plan_and_note(*a):
                made = plan(*a)
                planned.append((threading.current_thread().name, made.rows is not None))
                return made

            tr.tables.plan_next_batch = plan_and_note
            before = tr.pull_rows("emb", torch.from_numpy(VOCAB))
            fetched_by_lookups.clear()
            for ids, bag, y in tr.batches(
                [b[0] for b in data], 1, prefetch=lambda b: {"emb": b[0], "bag": b[1]}
            ):
                nn.functional.cross_entropy(tr.model(ids, bag), y).backward()
                tr.step()
            return list(fetched_by_lookups), planned, before, tr.pull_rows("emb", torch.from_numpy(VOCAB))

        fetched_by_lookups, planned, before, after = cluster.run_trainers(body)[0]
    assert sorted(fetched_by_lookups) == [["bag"], ["emb"]]  # the first batch's lookups only
    assert planned == [("trainer-feed_0", True)] * 5  # batches 1-5, rows and all
    assert not torch.equal(before, after)


def delayed_tables(prog: Program, data):
    """The pipelined schedule with tables (sgd everywhere), rows included: (dense state, {table: rows})."""
    model, specs, _, _ = local_tables(prog)
    lrs = {
        n: next(
            (s.optimizer.kwargs["lr"] for t, s in specs.items() if n.startswith(t + ".")),
            prog.optimizer.kwargs["lr"],
        )
        for n, _ in model.named_parameters()
    }

    def loss(ids, bag, y):
        return lambda: nn.functional.cross_entropy(model(positions(VOCAB, ids), positions(BAG_VOCAB, bag)), y)

    server = delayed(model, lrs, [loss(*b) for (b,) in data])
    dense = {n: t for n, t in server.items() if not n.startswith(tuple(specs))}
    return dense, {t: server[t + ".weight"] for t in specs}


@pytest.mark.timeout(60)
def test_pipelined_rows_are_one_step_stale_like_the_blocks_and_exact():
    """One trainer, tables and the pipeline: the rows the feed thread fetches for batch s+1 wait for the
    push of step s-1, so batch s+1 computes on the rows and the blocks of the same step (s), and the
    job is the delayed single-process schedule exactly (a fetch racing that push made it two steps for
    some rows, more often the busier the machine)."""

    def build():
        return table_program("sgd", torch.float64, lr=0.5)

    data = table_batches(1, 16, 8, seed=3)
    dense, rows = delayed_tables(build(), data)
    with LocalCluster(build, 2, 1, sync_mode=False, config=PIPELINED) as cluster:

        def body(tr, _):
            for ids, bag, y in tr.batches(
                [b for (b,) in data], 1, prefetch=lambda b: {"emb": b[0], "bag": b[1]}
            ):
                nn.functional.cross_entropy(tr.model(ids, bag), y).backward()
                tr.step()
            state = tr.state_dict()
            return (
                state,
                tr.pull_rows("emb", torch.from_numpy(VOCAB)),
                tr.pull_rows("bag", torch.from_numpy(BAG_VOCAB)),
            )

        state, emb, bag = cluster.run_trainers(body)[0]
    for name in dense:
        torch.testing.assert_close(state[name], dense[name], **FLOAT64_EXACT, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(emb, rows["emb"], **FLOAT64_EXACT)
    torch.testing.assert_close(bag, rows["bag"], **FLOAT64_EXACT)
