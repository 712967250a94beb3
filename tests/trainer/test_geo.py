"""GEO mode (``k_steps``): trainers train their own copies and push the change every k steps.

One trainer in GEO trains exactly as one process with the same optimizer, for any k: its syncs
push its change and pull it back. Several trainers: a counting model, whose every step moves
each parameter and looked-up row by a known whole number per trainer, shows that a pserver holds
its start plus every pushed change divided by the number of trainers, nothing lost or doubled.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from harness.cluster import LocalCluster
from harness.models import FLOAT64_EXACT, batches, odd_mlp, train_concatenated
from tests.helpers.table_models import VOCAB, single_process, table_batches, table_program
from transpiler import DistributeTranspilerConfig, Program, TableOptions
from transpiler.tables import initial_rows

STEPS = 7  # not a multiple of most k: the last window syncs at close


def geo(k: int, **kwargs) -> DistributeTranspilerConfig:
    return DistributeTranspilerConfig(k_steps=k, **kwargs)


def dense_program(optimizer: str) -> Program:
    kwargs = {
        "adam": dict(lr=0.01, weight_decay=0.01),
        "momentum": dict(
            lr=0.05, momentum=0.9, lr_scheduler="StepLR", lr_scheduler_kwargs={"step_size": 2, "gamma": 0.5}
        ),
    }[optimizer]
    return Program(odd_mlp(dtype=torch.float64), optimizer, **kwargs)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("k", [1, 3, 5, 8])
@pytest.mark.parametrize("optimizer", ["adam", "momentum"])
def test_one_geo_trainer_trains_as_one_process_for_any_k(optimizer, k):
    """The optimizer's state stays on the trainer across syncs; the learning rate follows the schedule."""
    data = batches(1, 8, STEPS, dtype=torch.float64)
    expected = train_concatenated(dense_program(optimizer), data)
    with LocalCluster(lambda: dense_program(optimizer), 2, 1, sync_mode=False, config=geo(k)) as cluster:

        def body(tr, i):
            for ((x, y),) in data:
                nn.functional.cross_entropy(tr.model(x), y).backward()
                tr.step()
            return tr.state_dict()

        state = cluster.run_trainers(body)[0]
        pserver_step = [s.engine.step for s in cluster.servers]
    for name in expected:
        torch.testing.assert_close(state[name], expected[name], **FLOAT64_EXACT, msg=lambda m: f"{name}: {m}")
    assert pserver_step == [-(-STEPS // k)] * 2  # one push per window, the last one partial


@pytest.mark.timeout(60)
@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("ahead", [False, True])
def test_one_geo_trainer_with_tables_trains_as_one_process(k, ahead):
    """Table rows train on the trainer between syncs (sgd), read back from there by later lookups.

    ``ahead``: ``batches(prefetch=)`` fetches the next batch's rows while one trains, and at a
    sync asks for them with the push: a lookup still reads a row touched since the sync from here."""

    def build():
        return table_program(
            "adam",
            torch.float64,
            lr=0.01,
            tables={
                "emb": TableOptions(optimizer="sgd", optimizer_kwargs={"lr": 0.5}),
                "bag": TableOptions(optimizer="sgd", optimizer_kwargs={"lr": 0.3}),
            },
        )

    data = table_batches(1, 6, STEPS)
    dense, rows = single_process(build(), data)
    with LocalCluster(build, 2, 1, sync_mode=False, config=geo(k)) as cluster:

        def body(tr, i):
            items = [b for (b,) in data]
            if ahead:
                items = tr.batches(items, 1, prefetch=lambda b: {"emb": b[0], "bag": b[1]})
            for ids, bag, y in items:
                nn.functional.cross_entropy(tr.model(ids, bag), y).backward()
                tr.step()
            state = tr.state_dict()
            return state, tr.pull_rows("emb", torch.from_numpy(VOCAB))

        state, emb = cluster.run_trainers(body)[0]
    for name in dense:
        torch.testing.assert_close(state[name], dense[name], **FLOAT64_EXACT, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(emb, rows["emb"], **FLOAT64_EXACT)


@pytest.mark.timeout(90)
def test_geo_syncs_at_every_documented_sync_point(tmp_path):
    """docs/modes.md: every ``k_steps`` steps, each epoch's end of ``batches()``, ``pull()``,
    ``state_dict()``, ``checkpoint()``, ``save_tables()`` and ``close()``, each a push to every pserver
    when the trainer trained since its last sync, and none otherwise. k = 5 over 2 epochs of 7 batches:
    syncs after batches 5 and 7 of each epoch, the epoch's end before the next epoch's first batch."""
    build = lambda: table_program(  # noqa: E731
        "sgd",
        torch.float64,
        lr=0.1,
        tables={"emb": TableOptions(optimizer="sgd"), "bag": TableOptions(optimizer="sgd")},
    )
    items = [b for (b,) in table_batches(1, 4, 7)]
    config = geo(5, checkpoint_dir=str(tmp_path / "ckpt"))
    with LocalCluster(build, 2, 1, sync_mode=False, config=config) as cluster:

        def pushes() -> int:
            steps = {s.engine.step for s in cluster.servers}  # a GEO pserver's step counts its pushes
            assert len(steps) == 1, steps
            return steps.pop()

        def train(tr, item):
            ids, bag, y = item
            nn.functional.cross_entropy(tr.model(ids, bag), y).backward()
            tr.step()

        def body(tr, _):
            counts = {"batches": []}
            for item in tr.batches(items, 2, prefetch=lambda b: {"emb": b[0], "bag": b[1]}):
                train(tr, item)
                counts["batches"].append(pushes())
            counts["after batches"] = pushes()
            counts["position"] = tuple(tr.position)
            for point, call in (
                ("pull", tr.pull),
                ("state_dict", tr.state_dict),
                ("checkpoint", tr.checkpoint),
                ("save_tables", lambda: tr.save_tables(str(tmp_path / "tables"))),
            ):
                before = pushes()
                call()
                counts[f"{point}, nothing trained"] = pushes() - before
                train(tr, items[0])
                call()
                counts[point] = pushes() - before
            train(tr, items[1])
            counts["before close"] = pushes()
            return counts

        counts = cluster.run_trainers(body)[0]
        after_close = pushes()
    # Before the fix the epoch's end synced nothing: 1 (batch 5), 2 (batch 10), 3 (the pull after the loop).
    assert counts.pop("batches") == [0, 0, 0, 0, 1, 1, 1] + [2, 2, 2, 2, 3, 3, 3]
    assert counts.pop("after batches") == 4
    assert counts.pop("position") == (2, 0)
    assert counts == {
        "pull, nothing trained": 0,
        "pull": 1,
        "state_dict, nothing trained": 0,
        "state_dict": 1,
        "checkpoint, nothing trained": 0,
        "checkpoint": 1,
        "save_tables, nothing trained": 0,
        "save_tables": 1,
        "before close": 8,
    }
    assert after_close == 9


class Counting(nn.Module):
    """A vector split into blocks across pservers, and a table: every step moves each by a fixed amount."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(3 * 8192, dtype=torch.float64))
        self.emb = nn.Embedding(100, 2, sparse=True, dtype=torch.float64)

    def forward(self, ids, weight: float):
        # d(-loss)/dw = weight everywhere; each row looked up (once per step) gets weight too.
        return -weight * (self.w.sum() + self.emb(ids).sum())


WEIGHTS = (1.0, 1000.0)  # trainer 0 counts in units, trainer 1 in thousands


@pytest.mark.timeout(60)
@pytest.mark.parametrize("k,steps", [(3, (10, 7)), (4, (8, 8))])
def test_geo_pservers_hold_every_pushed_change_divided_by_the_trainers(k, steps):
    """SGD at lr 1 moves w by weight per step: trainer t's syncs push k * weight (less at close), and
    the pservers add each divided by 2. Rows: each looked-up row moves by weight per step that saw it."""
    rng = np.random.default_rng(3)
    lookups = [[np.unique(rng.integers(-50, 50, size=6)) for _ in range(steps[t])] for t in range(2)]

    def build():
        return Program(Counting(), "sgd", lr=1.0, distributed_tables=["emb"])

    with LocalCluster(build, 2, 2, sync_mode=False, config=geo(k)) as cluster:

        def body(tr, t):
            for ids in lookups[t]:
                tr.model(torch.from_numpy(ids), WEIGHTS[t]).backward()
                tr.step()

        cluster.run_trainers(body)
        with cluster.trainer(0) as tr:  # a trainer that joins now reads what the pservers hold
            w = tr.state_dict()["w"]
            ids = np.arange(-50, 50)
            rows = tr.pull_rows("emb", torch.from_numpy(ids))
        pserver_step = sum(s.engine.step for s in cluster.servers)
    expected_w = sum(w_t * n for w_t, n in zip(WEIGHTS, steps)) / 2
    assert torch.equal(w, torch.full_like(w, expected_w))
    seen = [
        sum(np.isin(ids, s).astype(np.int64) for s in lookups[t]) for t in range(2)
    ]  # steps that saw each row
    spec = build().tables[0]
    start = torch.from_numpy(initial_rows(spec, ids))
    moved = torch.from_numpy((WEIGHTS[0] * seen[0] + WEIGHTS[1] * seen[1]) / 2)[:, None].expand(-1, 2)
    torch.testing.assert_close(rows, start + moved, rtol=0, atol=1e-9)
    # Each pserver took one push per window of each trainer.
    assert pserver_step == 2 * sum(-(-n // k) for n in steps)


def test_geo_is_refused_in_sync_mode_and_with_stateful_tables():
    with pytest.raises(ValueError, match="GEO mode, which is asynchronous"):
        LocalCluster(lambda: dense_program("adam"), 1, 1, sync_mode=True, config=geo(2)).transpiler()
    build = lambda: table_program("adam", torch.float64, lr=0.01)  # noqa: E731 - tables derive adam
    with pytest.raises(ValueError, match=r"tables \['bag', 'emb'\] use another optimizer"):
        LocalCluster(build, 1, 1, sync_mode=False, config=geo(2)).transpiler()
    with pytest.raises(ValueError, match="does not combine with max_staleness, async_pipeline"):
        geo(2, max_staleness=3, async_pipeline=True)
