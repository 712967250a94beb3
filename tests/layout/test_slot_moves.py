"""Moving table slots between live shards equals saving the shards and loading them re-sharded: every row
with its optimizer state and lifecycle metadata (disk tier included), and training goes on alike."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from pserver.layout.slot_moves import drop_slots, put_slots, slot_mask, take_slots
from pserver.tables.shard import TableShard
from tests.helpers.table_specs import grads_for, make_spec
from transpiler.layout.moves import slots_between
from transpiler.layout.routing import N_SLOTS
from transpiler.lifecycle import TableLifecycle
from transpiler.tables import shard_of

IDS = np.arange(3000, dtype=np.int64) * 7919 - 10**6
EVERY_SLOT = np.ones(N_SLOTS, dtype=bool)

RULES = {
    "plain": {},
    "evict by steps": {"evict_unseen_steps": 3},
    "admission + score": {"admit_count": 2, "evict_score_below": 0.5, "score_decay": 0.8},
    "disk tier": {"ram_rows": 300},
}


def spec_with(optimizer, rules):
    return dataclasses.replace(
        make_spec(dim=4, optimizer=optimizer), lifecycle=TableLifecycle(**RULES[rules])
    )


def train(shards, steps, seed):
    rng = np.random.default_rng(seed)
    n = shards[0].n_shards
    for step in range(steps):
        ids = np.unique(rng.choice(IDS, size=800)).astype(np.int64)
        g = grads_for(ids, 4, seed + step)
        owner = shard_of(ids, n)
        for s in shards:
            s.apply(ids[owner == s.shard], g[owner == s.shard], 0.1)


def held(shard):
    """Everything a shard holds, by id: {id: (row, state..., metadata...)} as tuples of floats."""
    got = take_slots(shard, EVERY_SLOT)
    arrays = [got.rows, *got.state, *got.meta.values()]
    order = np.argsort(got.ids)
    return got.ids[order], [a[order] for a in arrays]


def assert_same(a, b):
    ids_a, arrays_a = held(a)
    ids_b, arrays_b = held(b)
    np.testing.assert_array_equal(ids_a, ids_b)
    for x, y in zip(arrays_a, arrays_b):
        np.testing.assert_array_equal(x, y)
    assert (a.shard, a.n_shards, a.step) == (b.shard, b.n_shards, b.step)


def move(shards, n_next, disk_dir):
    """The live shards of ``len(shards)`` pservers made ``n_next``: slots streamed, then dropped."""
    n_now = len(shards)
    spec = shards[0].spec
    out = shards[:n_next] + [TableShard(spec, k, n_next, disk_dir) for k in range(n_now, n_next)]
    step = max(s.step for s in shards)
    for (a, b), slots in slots_between(n_now, n_next).items():
        mask = slot_mask(slots)
        put_slots(out[b], mask, take_slots(shards[a], mask))
        drop_slots(shards[a], mask)
    for k, s in enumerate(out):
        s.relabel(k, n_next, step)
    return out


def reference(shards, n_next, directory, disk_dir):
    dirs = []
    for s in shards:
        d = os.path.join(directory, f"shard{s.shard}")
        s.save(d)
        dirs.append(d)
    return [TableShard.load(shards[0].spec, k, n_next, dirs, disk_dir) for k in range(n_next)]


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
@pytest.mark.parametrize("rules", sorted(RULES))
def test_moving_slots_2_to_3_to_2_equals_a_re_sharded_load_and_trains_alike(tmp_path, optimizer, rules):
    spec = spec_with(optimizer, rules)
    disk = str(tmp_path / "disk")
    live = [TableShard(spec, k, 2, disk) for k in range(2)]
    train(live, 6, seed=1)
    want = reference(live, 3, str(tmp_path / "a"), disk)
    live = move(live, 3, disk)
    for a, b in zip(live, want):
        assert_same(a, b)
    train(live, 4, seed=2)
    train(want, 4, seed=2)
    want = reference(want, 2, str(tmp_path / "b"), disk)
    live = move(live, 2, disk)
    for a, b in zip(live, want):
        assert_same(a, b)
    for s in live + want:
        s.close_disk()


def test_putting_a_slot_twice_lands_once_and_a_foreign_id_changes_nothing():
    spec = spec_with("adagrad", "plain")
    src, dst = TableShard(spec, 0, 2), TableShard(spec, 1, 2)
    train([src, dst], 3, seed=4)
    (slots,) = [s for (a, b), s in slots_between(2, 3).items() if a == 0]
    mask = slot_mask(slots)
    moved = take_slots(src, mask)
    assert moved.ids.size > 0 and moved.nbytes > 0
    target = TableShard(spec, 2, 3)
    put_slots(target, mask, moved)
    put_slots(target, mask, moved)
    assert len(target) == moved.ids.size
    before = held(target)
    other = take_slots(dst, ~mask)
    with pytest.raises(ValueError, match="is not in the slots being put"):
        put_slots(target, mask, other)
    after = held(target)
    np.testing.assert_array_equal(before[0], after[0])
    with pytest.raises(ValueError, match="cannot go into table"):
        put_slots(target, mask, dataclasses.replace(moved, table="other"))
    assert drop_slots(src, mask) == moved.ids.size and drop_slots(src, mask) == 0
