"""The disk tier: a table several times its RAM budget trains exactly like the all-in-RAM table.

Shard level: with ``ram_rows`` the shard keeps its share in memory and the rest in LMDB, under
every rule and optimizer, and after every step its lookups and stored ids equal an all-in-RAM
shard's. A full disk fails the spill and changes nothing. Saves hold every row (memory and disk)
and load on another number of shards with their metadata. A SIGKILL in the middle of a spill
loses nothing the last save had. Job level: 2 pservers x 2 trainers, sync, a table 5x its
budget, equals single-process torch.
"""

import dataclasses
import logging
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from harness.cluster import LocalCluster
from pserver.tables.lifecycle import disk_tier
from pserver.tables.shard import TableShard
from tests.helpers import paths
from tests.helpers.table_models import BAG_VOCAB, VOCAB, single_process, table_batches, table_program
from tests.helpers.table_specs import grads_for, make_spec
from tests.tables.test_sync import assert_matches, train
from transpiler import DistributeTranspilerConfig
from transpiler.lifecycle import TableLifecycle
from transpiler.tables import shard_of

REPO = str(paths.REPO)
IDS = np.arange(400, dtype=np.int64) * 7919 - 1000


def spec_with(optimizer="sgd", **rules):
    return dataclasses.replace(make_spec(dim=4, optimizer=optimizer), lifecycle=TableLifecycle(**rules))


def train_step(shards, step, rng, n_shards=1):
    ids = np.unique(rng.choice(IDS, size=60)).astype(np.int64)
    g = grads_for(ids, 4, step)
    for s in shards:
        mine = shard_of(ids, n_shards) == s.shard
        s.apply(ids[mine], g[mine], 0.1)


RULES = {
    "ram only": {},
    "evict by steps": {"evict_unseen_steps": 6},
    "admission + score": {"admit_count": 2, "evict_score_below": 0.5, "score_decay": 0.8},
}


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
@pytest.mark.parametrize("rules", sorted(RULES))
def test_tiered_shard_equals_the_all_in_ram_shard(tmp_path, optimizer, rules):
    tiered = TableShard(spec_with(optimizer, ram_rows=50, **RULES[rules]), 0, 1, str(tmp_path))
    ram = TableShard(spec_with(optimizer, **RULES[rules]), 0, 1)
    rng_a, rng_b = np.random.default_rng(0), np.random.default_rng(0)
    biggest = 0
    for step in range(60):
        train_step([tiered], step, rng_a)
        train_step([ram], step, rng_b)
        assert len(tiered) <= 50  # the budget holds at every step end
        np.testing.assert_array_equal(tiered.lookup(IDS), ram.lookup(IDS))
        biggest = max(biggest, tiered.rows_held)
    assert sorted(tiered.stored_ids().tolist()) == sorted(ram.stored_ids().tolist())
    assert tiered.rows_held == ram.rows_held
    c = tiered.life.counts
    assert c.spilled > 0 and c.promoted > 0
    if rules == "ram only":
        assert biggest >= 4 * 50  # at least 4x its budget
    tiered.close_disk()


def test_a_full_disk_fails_the_spill_and_keeps_the_rows(tmp_path, monkeypatch, caplog):
    """The store's size limit is tiny: spills fail with a logged error naming the directory, the
    rows stay in memory, and training goes on exactly as the all-in-RAM table."""
    monkeypatch.setattr(disk_tier.DiskTier.__init__, "__defaults__", (8 * 1024,))
    tiered = TableShard(spec_with(ram_rows=10), 0, 1, str(tmp_path))
    ram = TableShard(spec_with(), 0, 1)
    rng_a, rng_b = np.random.default_rng(1), np.random.default_rng(1)
    with caplog.at_level(logging.ERROR):
        for step in range(40):
            train_step([tiered], step, rng_a)
            train_step([ram], step, rng_b)
            np.testing.assert_array_equal(tiered.lookup(IDS), ram.lookup(IDS))
    assert tiered.disk.spill_failures > 0 and len(tiered) > 10
    assert tiered.rows_held == ram.rows_held
    assert any("is full" in r.getMessage() and str(tmp_path) in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("n_to", [2, 3])
def test_saves_hold_every_row_and_reshard_with_metadata(tmp_path, n_to):
    spec = spec_with(ram_rows=40, evict_score_below=0.4, score_decay=0.9)
    shards = [TableShard(spec, k, 2, str(tmp_path / "tier")) for k in range(2)]
    rng = np.random.default_rng(3)
    for step in range(30):
        train_step(shards, step, rng, n_shards=2)
    assert all(s.disk_rows > 0 for s in shards)
    dirs = [str(tmp_path / f"saved-{k}") for k in range(2)]
    for s, d in zip(shards, dirs):
        s.save(d)
    loaded = [TableShard.load(spec, k, n_to, dirs, str(tmp_path / "tier2")) for k in range(n_to)]

    def content(ss):
        out = {}
        for s in ss:
            with s.reading() as memory:
                ids = np.concatenate([memory.ids, *s.disk.field_chunks(-1)])
                fields = [
                    np.concatenate([a, *s.disk.field_chunks(i)])
                    for i, a in enumerate([memory.rows, *memory.meta.values()])
                ]
            for j, i in enumerate(ids.tolist()):
                out[i] = tuple(f[j].tolist() for f in fields)
        return out

    before, after = content(shards), content(loaded)
    assert after == before and len(before) > 80
    assert all(len(s) <= -(-40 // n_to) for s in loaded)  # loading spills as it goes


CHILD = r"""
import os, sys, time, dataclasses
import numpy as np
sys.path.insert(0, {repo!r})
from tests.tables.test_tiering import spec_with, train_step
from pserver.tables.shard import TableShard
from pserver.tables.lifecycle import disk_tier
shard = TableShard(spec_with("adagrad", ram_rows=30), 0, 1, {tier!r})
rng = np.random.default_rng(7)
for step in range(10):
    train_step([shard], step, rng)
shard.save({saved!r})
real_put = disk_tier.DiskTier.put
def half_then_hang(self, ids, records):
    # Half of the spill's records are committed to the store, then the process is killed.
    real_put(self, ids[:ids.size // 2], records[:ids.size // 2])
    print("spilling", flush=True)
    time.sleep(60)
disk_tier.DiskTier.put = half_then_hang
for step in range(10, 20):
    train_step([shard], step, rng)
"""


@pytest.mark.timeout(60)
def test_sigkill_in_the_middle_of_a_spill_loses_nothing_the_save_had(tmp_path):
    tier, saved = str(tmp_path / "tier"), str(tmp_path / "saved")
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD.format(repo=REPO, tier=tier, saved=saved)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "spilling"
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(10)
    assert child.returncode == -signal.SIGKILL
    assert os.path.isdir(tier)  # the half-written store is there
    spec = spec_with("adagrad", ram_rows=30)
    resumed = TableShard.load(spec, 0, 1, [saved], tier)  # a restart: fresh store, the save's rows
    reference = TableShard(spec_with("adagrad"), 0, 1)
    rng_a, rng_b = np.random.default_rng(7), np.random.default_rng(7)
    for step in range(10):
        train_step([reference], step, rng_b)
        rng_a.choice(IDS, size=60)  # the resumed run skips steps 0-9
    np.testing.assert_array_equal(resumed.lookup(IDS), reference.lookup(IDS))
    for step in range(10, 25):
        train_step([resumed], step, rng_a)
        train_step([reference], step, rng_b)
    np.testing.assert_array_equal(resumed.lookup(IDS), reference.lookup(IDS))
    assert resumed.life.counts.spilled > 0
    resumed.close_disk()


@pytest.mark.timeout(90)
def test_sync_job_with_tables_five_times_their_budget_equals_single_process(tmp_path):
    rules = {"ram_rows": 8}
    tables = {"emb": {"lifecycle": rules}, "bag": {"lifecycle": rules}}
    build = lambda: table_program("adam", tables=tables, lr=0.05)  # noqa: E731
    data = table_batches(2, 8, 8, seed=6)
    config = DistributeTranspilerConfig(table_disk_dir=str(tmp_path))
    with LocalCluster(build, 2, 2, config=config) as cluster:
        results = train(cluster, data)
        shards = [s.engine.tables.shards["emb"] for s in cluster.servers]
        # The final pull_rows looked up every id, which brought them all back to memory.
        assert sum(s.rows_held for s in shards) >= 5 * 8 - 10
        assert all(s.life.counts.spilled and s.life.counts.promoted for s in shards)
    expected = single_process(build(), data)
    for i in (0, 1):
        assert_matches(results[i], expected)
    assert not os.listdir(tmp_path)  # stopped pservers remove their stores


@pytest.mark.timeout(90)
def test_a_restarted_pserver_restores_its_disk_tier_from_the_checkpoint_and_the_job_stays_exact(
    tmp_path, caplog
):
    """A sync job with a disk tier and eviction checkpoints at step 5, trains 3 more steps; pserver 1
    stops and starts again from the checkpoint (its working store emptied, rows loaded from the
    checkpoint files and spilled again), both roll back, the trainer redoes the steps: the model
    equals the single-process reference of the rules over all the data."""
    from tests.helpers.lifecycle_reference import single_process_lifecycle

    rules = {"ram_rows": 6, "evict_unseen_steps": 4, "admit_count": 2}
    tables = {"emb": {"lifecycle": rules}, "bag": {"lifecycle": rules}}
    build = lambda: table_program("adagrad", tables=tables, lr=0.3)  # noqa: E731
    data = table_batches(1, 12, 12, seed=8)
    config = DistributeTranspilerConfig(
        checkpoint_dir=str(tmp_path / "ckpt"), barrier_timeout=30.0, table_disk_dir=str(tmp_path / "tier")
    )

    def train(tr, steps):
        for step_batches in steps:
            ids, bag, y = step_batches[0]
            nn.functional.cross_entropy(tr.model(ids, bag), y).backward()
            tr.step()

    with LocalCluster(build, 2, 1, config=config) as cluster:
        with cluster.trainer(0) as tr:
            train(tr, data[:5])
            tr.checkpoint()
            train(tr, data[5:8])
            assert all(s.engine.tables.shards["emb"].disk_rows for s in cluster.servers)
            cluster.servers[1].stop()
            cluster.restart_pserver(1)  # back at the checkpoint of step 5
            tr.pull()
            assert tr.step_count == 5
            restored = cluster.servers[1].engine.tables.shards["emb"]
            assert restored.disk_rows and len(restored) <= 3  # loaded, and spilled to its share again
            train(tr, data[5:])
            result = (
                tr.state_dict(),
                {
                    "emb": tr.pull_rows("emb", torch.from_numpy(VOCAB)),
                    "bag": tr.pull_rows("bag", torch.from_numpy(BAG_VOCAB)),
                },
            )
    state, rows, _ = single_process_lifecycle(build(), data)
    assert_matches(result, (state, rows))
    assert "rolled back from step 8" in caplog.text
