"""Scheduled exports of live tables: base + deltas read by the serving reader equal the live table.

A sync job with admission and eviction exports every 2 steps (every third export a base);
after each export the numpy-only reader, refreshed, holds exactly the ids the pservers hold,
with their rows, and none of the evicted ids. A pserver rolled back (restored from older
state) writes a resync delta, after which the reader again equals the live table.
"""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
from torch import nn

from harness.cluster import LocalCluster
from pserver.tables.serving.exporter import TableExporter, export_plan
from pserver.tables.serving.reader import ServingTables
from pserver.tables.shard import TableShard
from tests.helpers.table_models import VOCAB, table_batches, table_program
from tests.helpers.table_specs import grads_for, make_spec
from transpiler import DistributeTranspilerConfig
from transpiler.lifecycle import TableLifecycle
from transpiler.tables import shard_of


@pytest.mark.parametrize(
    "step,plan",
    [
        (0, None),
        (3, None),
        (2, ("000000000002-base", "base", None)),
        (4, ("000000000004-delta", "delta", "000000000002-base")),
        (6, ("000000000006-base", "base", None)),
        (8, ("000000000008-delta", "delta", "000000000006-base")),
        (10, ("000000000010-delta", "delta", "000000000008-delta")),
    ],
)
def test_export_plan_is_a_function_of_the_step(step, plan):
    assert export_plan(step, 2, 3) == plan


def live_table(shards):
    ids = np.concatenate([s.stored_ids() for s in shards])
    order = np.argsort(ids)
    rows = np.concatenate([s.lookup(s.stored_ids()) for s in shards])
    return ids[order], rows[order]


def assert_reader_equals_live(reader, table, shards):
    ids, rows = live_table(shards)
    np.testing.assert_array_equal(reader.ids(table), ids)
    got, found = reader.lookup(table, ids)
    assert found.all()
    np.testing.assert_array_equal(got, rows)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n_pservers", [2, 3])
def test_exports_of_a_training_job_equal_the_live_table(tmp_path, n_pservers):
    root = str(tmp_path / "exports")
    config = DistributeTranspilerConfig(export_dir=root, export_every=2, export_base_every=3)
    rules = {"admit_count": 2, "evict_unseen_steps": 3}
    build = lambda: table_program("adagrad", tables={"emb": {"lifecycle": rules}, "bag": None}, lr=0.3)  # noqa: E731
    data = table_batches(2, 6, 15, seed=3)
    reader = ServingTables(root)
    checked = []
    with LocalCluster(build, n_pservers, 2, config=config) as cluster:
        shards = {t: [s.engine.tables.shards[t] for s in cluster.servers] for t in ("emb", "bag")}

        def body(tr, i):
            for step, step_batches in enumerate(data, start=1):
                ids, bag, y = step_batches[i]
                nn.functional.cross_entropy(tr.model(ids, bag), y).backward()
                tr.step()
                if i == 0 and step % 2 == 0:  # the step is applied and exported; trainer 0 holds the next one
                    for s in cluster.servers:
                        s.exporter.wait()
                    applied = reader.refresh()
                    assert applied and applied[-1].startswith(f"{step:012d}-")
                    for table in ("emb", "bag"):
                        assert_reader_equals_live(reader, table, shards[table])
                    evicted = np.setdiff1d(VOCAB, live_table(shards["emb"])[0])
                    assert not reader.lookup("emb", evicted)[1].any()
                    checked.append(applied)
            return None

        cluster.run_trainers(body)
        evictions = sum(s.life.counts.evicted for s in shards["emb"])
    assert len(checked) == 7 and evictions > 0
    # bases at exports 1, 3 and 6; the rest deltas, applied one at a time
    assert [a[-1][13:] for a in checked] == ["base", "delta", "base", "delta", "delta", "base", "delta"]


def test_a_restored_shard_writes_a_resync_delta(tmp_path):
    """A shard that lost its recent updates (restored from a save) cannot write a plain delta:
    its first delta after the restore holds every row and tombstones what the chain holds but it
    does not; the reader then equals the restored table."""
    root, saved = str(tmp_path / "exports"), str(tmp_path / "saved")
    spec = dataclasses.replace(make_spec(dim=3), lifecycle=TableLifecycle(evict_unseen_steps=2))
    shards = [TableShard(spec, k, 2) for k in range(2)]
    exporters = [
        TableExporter(SimpleNamespace(shards={"emb": s}, shard=k, n_shards=2), root, 1, 100, 2)
        for k, s in enumerate(shards)
    ]
    rng = np.random.default_rng(4)
    reader = ServingTables(root)

    def train(step):
        ids = np.unique(rng.integers(0, 60, size=25)).astype(np.int64)
        for k, s in enumerate(shards):
            mine = ids[shard_of(ids, 2) == k]
            s.apply(mine, grads_for(mine, 3, step), 0.2)
            exporters[k].after_update(s.step)
            exporters[k].wait()

    for step in range(1, 5):
        train(step)
    shards[1].save(saved)
    for step in range(5, 8):
        train(step)
    reader.refresh()
    assert_reader_equals_live(reader, "emb", shards)
    # pserver 1 restarts from its save: the updates of steps 5-7 are gone from it
    shards[1] = TableShard.load(spec, 1, 2, [saved])
    shards[1].step = shards[0].step  # both at the same step again, as after a roll-forward
    exporters[1] = TableExporter(
        SimpleNamespace(shards={"emb": shards[1]}, shard=1, n_shards=2), root, 1, 100, 2
    )
    train(8)
    assert reader.refresh() == ["000000000008-delta"]
    assert_reader_equals_live(reader, "emb", shards)
    for e in exporters:
        e.close()


@pytest.mark.parametrize("n_before, n_after", [(2, 3), (3, 2)])
def test_a_job_restarted_at_another_pserver_count_writes_resync_deltas_its_reader_takes(
    tmp_path, n_before, n_after
):
    """Restarted from a save at another pserver count, with some of its updates lost: each new shard's
    first delta tombstones the ids the chain (written by the old count) holds that are now its own and
    that it no longer holds, so the reader equals the restarted table: none left behind, none twice."""
    root, saved = str(tmp_path / "exports"), tmp_path / "saved"
    spec = dataclasses.replace(make_spec(dim=3), lifecycle=TableLifecycle(evict_unseen_steps=2))
    rng = np.random.default_rng(5)
    reader = ServingTables(root)

    def job(n):
        shards = [TableShard(spec, k, n) for k in range(n)]
        return shards, [
            TableExporter(SimpleNamespace(shards={"emb": s}, shard=k, n_shards=n), root, 1, 100, 2)
            for k, s in enumerate(shards)
        ]

    def train(shards, exporters, step):
        ids = np.unique(rng.integers(0, 80, size=30)).astype(np.int64)
        for k, s in enumerate(shards):
            mine = ids[shard_of(ids, len(shards)) == k]
            s.apply(mine, grads_for(mine, 3, step), 0.2)
            exporters[k].after_update(s.step)
            exporters[k].wait()

    shards, exporters = job(n_before)
    for step in range(1, 5):
        train(shards, exporters, step)
    dirs = [str(saved / f"shard{k}") for k in range(n_before)]
    for s, d in zip(shards, dirs):
        s.save(d)
    for step in range(5, 8):  # lost: the restart loads the save of step 4
        train(shards, exporters, step)
    reader.refresh()
    assert_reader_equals_live(reader, "emb", shards)
    before = set(live_table(shards)[0].tolist())
    for e in exporters:
        e.close()
    restarted = [TableShard.load(spec, k, n_after, dirs) for k in range(n_after)]
    for s in restarted:
        s.relabel(s.shard, n_after, shards[0].step)  # at the old job's step, as a resumed job's exports are
    shards, exporters = (
        restarted,
        [
            TableExporter(SimpleNamespace(shards={"emb": s}, shard=k, n_shards=n_after), root, 1, 100, 2)
            for k, s in enumerate(restarted)
        ],
    )
    gone_since = before - set(live_table(shards)[0].tolist())
    assert gone_since  # ids the chain holds that the restarted table does not
    train(shards, exporters, 8)
    assert reader.refresh() == ["000000000008-delta"]
    assert_reader_equals_live(reader, "emb", shards)
    for e in exporters:
        e.close()


@pytest.mark.timeout(90)
def test_exports_every_so_many_seconds_follow_pserver_0s_clock(tmp_path):
    """export_every_seconds: pserver 0's clock (a fake one here) says when; it announces the step two
    ahead in export_dir/NEXT and both pservers export there. The first is a base, the next a delta
    after it; after each, the reader equals the live table."""
    root = str(tmp_path / "exports")
    config = DistributeTranspilerConfig(export_dir=root, export_every_seconds=60.0, export_base_every=5)
    rules = {"evict_unseen_steps": 3}
    build = lambda: table_program("sgd", tables={"emb": {"lifecycle": rules}, "bag": None}, lr=0.3)  # noqa: E731
    data = table_batches(1, 12, 12, seed=5)
    reader = ServingTables(root)
    now = [1000.0]
    applied = {}
    with LocalCluster(build, 2, 1, config=config) as cluster:
        schedule = cluster.servers[0].exporter.schedule
        schedule.clock, schedule._since = (lambda: now[0]), now[0]
        shards = {t: [s.engine.tables.shards[t] for s in cluster.servers] for t in ("emb", "bag")}
        with cluster.trainer(0) as tr:
            for step, step_batches in enumerate(data, start=1):
                if step in (4, 8):
                    now[0] += 61.0  # pserver 0 announces at the end of this step
                ids, bag, y = step_batches[0]
                nn.functional.cross_entropy(tr.model(ids, bag), y).backward()
                tr.step()
                for s in cluster.servers:
                    s.exporter.wait()
                got = reader.refresh()
                if got:
                    applied[step] = got
                    for table in ("emb", "bag"):
                        assert_reader_equals_live(reader, table, shards[table])
    assert applied == {6: ["000000000006-base"], 10: ["000000000010-delta"]}


def test_export_every_seconds_is_refused_in_async_mode_and_with_export_every():
    with pytest.raises(ValueError, match="choose one schedule"):
        DistributeTranspilerConfig(export_dir="x", export_every=5, export_every_seconds=10.0)
    with pytest.raises(ValueError, match="need an export_dir"):
        DistributeTranspilerConfig(export_every_seconds=10.0)
    with pytest.raises(ValueError, match="needs sync mode"):
        TableExporter(SimpleNamespace(shards={}, shard=0, n_shards=1), "x", 0, 10, 2, 30.0, sync_mode=False)
