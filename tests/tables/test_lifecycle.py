"""Table lifecycle pieces: the policy's validation, admission, eviction decisions, row removal, files."""

import dataclasses

import numpy as np
import pytest

from pserver.tables import id_index
from pserver.tables.lifecycle.admission import Admission, CountSketch, admissible
from pserver.tables.lifecycle.eviction import budget_keep, coldest, lowest_ranked, sweep_due, sweep_victims
from pserver.tables.shard import TableShard
from tests.helpers.table_specs import grads_for, make_spec
from transpiler.lifecycle import TableLifecycle, table_lifecycle
from transpiler.tables import initial_rows, shard_of


def spec_with(dim=4, optimizer="sgd", **rules):
    return dataclasses.replace(make_spec(dim=dim, optimizer=optimizer), lifecycle=TableLifecycle(**rules))


# ---------------------------------------------------------------- the policy


@pytest.mark.parametrize(
    "rules,field",
    [
        ({"admit_count": 0}, "admit_count"),
        ({"admit_count": 70000}, "admit_count"),
        ({"admit_probability": 0.0}, "admit_probability"),
        ({"admit_probability": 1.5}, "admit_probability"),
        ({"admit_sketch_width": 1000}, "admit_sketch_width"),
        ({"admit_decay_steps": 10}, "admit_decay_steps"),  # needs admit_count > 1
        ({"evict_unseen_steps": -1}, "evict_unseen_steps"),
        ({"evict_unseen_steps": 2.5}, "evict_unseen_steps"),
        ({"evict_unseen_seconds": float("inf")}, "evict_unseen_seconds"),
        ({"score_decay": 0.5}, "score_decay"),  # no score rule to decay for
        ({"evict_score_below": 0.5}, "evict_score_below"),  # without decay a score is >= 1
        ({"evict_score_below": 1, "score_decay": 1.5}, "score_decay"),
        ({"sweep_every_steps": 0}, "sweep_every_steps"),
        ({"sweep_every_steps": 5}, "sweep_every_steps"),  # nothing to sweep for
        ({"max_rows": 1000, "ram_rows": 200}, "ram_rows"),
        ({"max_rows": True}, "max_rows"),
    ],
)
def test_contradictory_or_bad_settings_name_the_field(rules, field):
    with pytest.raises(ValueError, match=f"'emb': lifecycle {field}="):
        table_lifecycle(rules, "emb")


def test_unknown_setting_and_defaults():
    with pytest.raises(ValueError, match=r"unknown lifecycle settings \['evict_after'\]"):
        table_lifecycle({"evict_after": 3}, "emb")
    off = table_lifecycle(None, "emb")
    assert off.admits_all and not off.sweeps and not off.scores and not off.max_rows and not off.ram_rows


# ---------------------------------------------------------------- admission


def test_probability_is_a_pure_function_of_seed_and_id():
    ids = np.arange(-50_000, 50_000, dtype=np.int64)
    a = admissible(ids, 7, 0.3)
    assert abs(a.mean() - 0.3) < 0.01
    order = np.random.default_rng(0).permutation(ids.size)
    assert np.array_equal(admissible(ids[order], 7, 0.3), a[order])  # order does not matter
    assert not np.array_equal(admissible(ids, 8, 0.3), a)  # the seed does
    assert admissible(ids, 7, 1.0).all()
    # The same ids pass whichever shard they land on: the test does not see the shard count.
    for n in (2, 3):
        owner = shard_of(ids, n)
        assert sum(int(admissible(ids[owner == k], 7, 0.3).sum()) for k in range(n)) == int(a.sum())


def test_sketch_counts_exactly_without_collisions_and_halves():
    s = CountSketch(1 << 16)
    ids = np.arange(100, dtype=np.int64) * 7919
    assert s.add(ids).tolist() == [1] * 100
    assert s.add(ids[:10]).tolist() == [2] * 10
    assert s.count(ids).tolist() == [2] * 10 + [1] * 90
    s.halve()
    assert s.count(ids).tolist() == [1] * 10 + [0] * 90


def test_sketch_only_overcounts_and_conservative_update_keeps_it_small():
    """A small sketch full of distinct ids: estimates are never below the truth, rarely above."""
    rng = np.random.default_rng(1)
    s = CountSketch(1 << 12)
    truth = {}
    for _ in range(40):
        ids = np.unique(rng.integers(0, 3000, size=300)).astype(np.int64)
        s.add(ids)
        for i in ids.tolist():
            truth[i] = truth.get(i, 0) + 1
    keys = np.array(sorted(truth), dtype=np.int64)
    want = np.array([truth[k] for k in keys.tolist()])
    got = s.count(keys)
    assert (got >= want).all()
    assert (got > want).mean() < 0.05


def test_sketch_saturates_and_merges_by_sum():
    s = CountSketch(64)
    s.counters[:] = 65534
    assert s.add(np.array([5], dtype=np.int64)).tolist() == [65535]
    assert s.add(np.array([5], dtype=np.int64)).tolist() == [65535]
    a, b = CountSketch(1 << 10), CountSketch(1 << 10)
    a.add(np.array([1, 2], dtype=np.int64))
    b.add(np.array([2, 3], dtype=np.int64))
    a.merge_saved(b.counters)
    assert a.count(np.array([1, 2, 3], dtype=np.int64)).tolist() == [1, 2, 1]
    with pytest.raises(ValueError, match="admit_sketch_width changed"):
        a.merge_saved(CountSketch(1 << 11).counters)


def test_admission_counts_steps_and_decays():
    adm = Admission(TableLifecycle(admit_count=3, admit_decay_steps=2), seed=1)
    one = np.array([42], dtype=np.int64)
    assert adm.admit(one).tolist() == [False]  # count 1
    adm.end_step(1)
    assert adm.admit(one).tolist() == [False]  # count 2
    adm.end_step(2)  # halved to 1
    assert adm.admit(one).tolist() == [False]  # count 2
    assert adm.admit(one).tolist() == [True]  # count 3


# ---------------------------------------------------------------- eviction decisions

# (rules, step, seen_step, score, seen_time, now, expected victims)
SWEEPS = [
    ({"evict_unseen_steps": 3}, 10, [10, 8, 7, 1], None, None, 0, [False, False, True, True]),
    ({"evict_unseen_seconds": 60.0}, 5, [5, 5, 5], None, [100.0, 40.0, 39.0], 100.0, [False, True, True]),
    (
        {"evict_score_below": 1.0, "score_decay": 0.5},
        4,
        [4, 3, 3, 2],
        [1.0, 2.0, 1.5, 3.0],
        None,
        0,
        [False, False, True, True],
    ),  # decayed: 1.0, 1.0, 0.75, 0.75
    (
        {"evict_unseen_steps": 5, "evict_score_below": 2.0, "score_decay": 0.9},
        10,
        [10, 4, 9],
        [5.0, 9.0, 1.0],
        None,
        0,
        [False, True, True],
    ),
]


@pytest.mark.parametrize("rules,step,seen,score,seen_time,now,want", SWEEPS)
def test_sweep_victims(rules, step, seen, score, seen_time, now, want):
    lc = TableLifecycle(**rules)
    arr = lambda v: None if v is None else np.array(v, dtype=np.float64)  # noqa: E731
    got = sweep_victims(lc, step, now, np.array(seen, dtype=np.int64), arr(score), arr(seen_time))
    assert got.tolist() == want


@pytest.mark.parametrize("every,step,due", [(1, 7, True), (4, 8, True), (4, 9, False)])
def test_sweep_due(every, step, due):
    assert sweep_due(TableLifecycle(evict_unseen_steps=2, sweep_every_steps=every), step) is due


@pytest.mark.parametrize(
    "max_rows,n_shards,n_rows,keep",
    [(0, 2, 10**6, None), (100, 2, 50, None), (100, 2, 51, 45), (100, 3, 34, None), (100, 3, 35, 30)],
)
def test_budget_keep(max_rows, n_shards, n_rows, keep):
    assert budget_keep(TableLifecycle(max_rows=max_rows), n_rows, n_shards) == keep


def test_lowest_ranked_breaks_ties_by_age_then_id():
    ids = np.array([50, 40, 30, 20, 10], dtype=np.int64)
    seen = np.array([5, 5, 4, 5, 5], dtype=np.int64)
    score = np.array([2.0, 1.0, 1.0, 1.0, 3.0])
    # score 1.0: id 30 (oldest), then 20, then 40; then score 2.0: id 50
    assert ids[lowest_ranked(4, 5, 1.0, ids, seen, score)].tolist() == [30, 20, 40, 50]


def test_coldest_partition_matches_a_full_sort():
    rng = np.random.default_rng(3)
    ids = rng.permutation(10_000).astype(np.int64)
    seen = rng.integers(0, 50, size=10_000)
    full = np.lexsort((ids, seen))
    for n in (1, 100, 2000, 9000):
        assert sorted(coldest(n, ids, seen).tolist()) == sorted(full[:n].tolist())


# ---------------------------------------------------------------- the shard


@pytest.fixture(params=["compiled", "numpy rounds"])
def index_kind(request, monkeypatch):
    if request.param == "numpy rounds":
        monkeypatch.setattr(id_index, "_compiled", lambda *arrays: None)
    return request.param


def test_evicted_rows_free_their_slots_and_the_index_stays_exact(index_kind):
    """Many rounds of inserts and evictions: the index finds every live id, no evicted one, and the
    capacity stops growing once the live set is steady."""
    spec = spec_with(dim=2, evict_unseen_steps=2)
    t = TableShard(spec, 0, 1)
    rng = np.random.default_rng(5)
    model = {}
    caps = []
    for step in range(1, 120):
        ids = np.unique(rng.integers(-(10**12), 10**12, size=400)).astype(np.int64)
        if step > 1:  # some live ids again, so rows of every age are mixed
            ids = np.unique(np.concatenate([ids, rng.choice(np.array(sorted(model)), 100)]))
        t.apply(ids, np.ones((ids.size, 2), np.float32), 0.5)
        for i in ids.tolist():
            model[i] = step
        model = {i: s for i, s in model.items() if step - s < 2}
        caps.append(t.capacity)
        assert len(t) == len(model)
        live = np.array(sorted(model), dtype=np.int64)
        assert sorted(t.stored_ids().tolist()) == live.tolist()
        assert (probe_rows(t, live) >= 0).all()
    assert caps[-1] == caps[40]  # slots reused: no growth once steady
    gone = np.array([i for i in range(-5, 5)], dtype=np.int64)
    assert (probe_rows(t, gone) < 0).all()


def probe_rows(t, ids):
    return t.memory.find(ids, want_stop=False)[0]


def test_an_evicted_id_comes_back_from_its_initial_row_and_fresh_state():
    spec = spec_with(optimizer="adagrad", evict_unseen_steps=1)
    t = TableShard(spec, 0, 1)
    one = np.array([77], dtype=np.int64)
    t.apply(one, grads_for(one, 4, 0), 0.1)
    trained = t.lookup(one)
    t.apply(np.array([5], dtype=np.int64), grads_for([5], 4, 1), 0.1)  # 77 unseen for 1 step: gone
    assert sorted(t.stored_ids().tolist()) == [5]
    np.testing.assert_array_equal(t.lookup(one), initial_rows(spec, one))
    assert not np.allclose(trained, initial_rows(spec, one))
    fresh = TableShard(spec, 0, 1)
    fresh.step = t.step
    t.apply(one, grads_for(one, 4, 2), 0.1)
    fresh.apply(one, grads_for(one, 4, 2), 0.1)
    np.testing.assert_array_equal(t.lookup(one), fresh.lookup(one))  # state reset: adagrad's sum too


def test_wall_clock_eviction_uses_the_injected_clock():
    t = TableShard(spec_with(evict_unseen_seconds=30.0), 0, 1)
    now = [1000.0]
    t.life.clock = lambda: now[0]
    t.apply(np.array([1, 2], dtype=np.int64), np.zeros((2, 4), np.float32), 0.1)
    now[0] = 1020.0
    t.apply(np.array([2], dtype=np.int64), np.zeros((1, 4), np.float32), 0.1)
    now[0] = 1030.0
    t.apply(np.empty(0, dtype=np.int64), np.zeros((0, 4), np.float32), 0.1)
    assert t.stored_ids().tolist() == [2]
    assert t.life.counts.by_rule == {"sweep": 1}


def test_row_budget_keeps_the_best_ranked_rows():
    t = TableShard(spec_with(max_rows=20), 0, 1)
    hot = np.arange(10, dtype=np.int64)
    for step in range(5):
        t.apply(hot, np.zeros((10, 4), np.float32), 0.1)
    cold = np.arange(100, 111, dtype=np.int64)  # 21 rows: over budget, keep 18
    t.apply(cold, np.zeros((11, 4), np.float32), 0.1)
    kept = sorted(t.stored_ids().tolist())
    # the hot rows (score 5) stay; among the cold ones (score 1, same step) the smallest ids go
    assert kept == hot.tolist() + list(range(103, 111))
    assert t.life.counts.by_rule == {"budget": 3}


@pytest.mark.parametrize("n_from,n_to", [(2, 2), (2, 3)])
def test_metadata_and_sketch_survive_save_load_and_reshard(tmp_path, n_from, n_to):
    spec = spec_with(admit_count=3, evict_score_below=0.6, score_decay=0.7)
    rng = np.random.default_rng(8)
    shards = [TableShard(spec, k, n_from) for k in range(n_from)]
    for step in range(12):
        ids = np.unique(rng.integers(0, 300, size=120)).astype(np.int64)
        for k, s in enumerate(shards):
            mine = ids[shard_of(ids, n_from) == k]
            s.apply(mine, grads_for(mine, 4, step), 0.1)
    dirs = []
    for k, s in enumerate(shards):
        dirs.append(str(tmp_path / f"shard-{k}"))
        s.save(dirs[-1])
    loaded = [TableShard.load(spec, k, n_to, dirs) for k in range(n_to)]

    def table(ss):
        out = {}
        for s in ss:
            n = len(s)
            memory = s.memory
            for j, i in enumerate(memory.ids[:n].tolist()):
                out[i] = (
                    memory.rows[j].tolist(),
                    int(memory.meta["seen_step"][j]),
                    float(memory.meta["score"][j]),
                )
        return out

    assert table(loaded) == table(shards) and len(table(shards)) > 20
    probe_ids = np.arange(300, dtype=np.int64)

    def counts(ss, n):
        return np.concatenate(
            [s.life.admission.sketch.count(probe_ids[shard_of(probe_ids, n) == k]) for k, s in enumerate(ss)]
        )

    if n_from == n_to:
        assert np.array_equal(counts(loaded, n_to), counts(shards, n_from))
    else:  # sums of the old shards' sketches: never below what one shard had counted
        old = dict(
            zip(
                np.concatenate([probe_ids[shard_of(probe_ids, n_from) == k] for k in range(n_from)]).tolist(),
                counts(shards, n_from).tolist(),
            )
        )
        new = dict(
            zip(
                np.concatenate([probe_ids[shard_of(probe_ids, n_to) == k] for k in range(n_to)]).tolist(),
                counts(loaded, n_to).tolist(),
            )
        )
        assert all(new[i] >= old[i] for i in old)
