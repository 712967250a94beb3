"""TableShard: the vectorised id index, torch-equivalent sparse optimizers, memory, threads."""

import dataclasses
import threading

import numpy as np
import pytest
import torch

from harness.models import FLOAT64_EXACT
from pserver.tables import id_index
from pserver.tables.compiled import row_kernels
from pserver.tables.fresh import FreshRows, fill_compiled, fill_numpy
from pserver.tables.id_index import build_index, home_slots, place, probe
from pserver.tables.rows import Growable
from pserver.tables.shard import TableShard
from tests.helpers.table_specs import grads_for, make_spec
from transpiler.tables import initial_rows, merge_duplicates, shard_of

I64 = np.iinfo(np.int64)


def stored_rows(t: TableShard, ids: np.ndarray) -> np.ndarray:
    """Row numbers of ``ids`` in ``t``'s index (-1 = missing)."""
    return t.memory.find(ids)[0]


# ---------------------------------------------------------------- index


@pytest.fixture(params=["compiled", "numpy rounds"])
def index_kind(request, monkeypatch):
    """Run a test with the compiled kernels (numba), then with the numpy rounds."""
    if request.param == "compiled":
        assert id_index.load_kernels() is not None, "numba is a dependency: the compiled kernels must load"
    else:
        monkeypatch.setattr(id_index, "_compiled", lambda *arrays: None)
        monkeypatch.setattr(row_kernels, "compiled_rows", lambda *args: None)  # a plain table's path too
    return request.param


def test_index_random_ids_across_growth(index_kind):
    rng = np.random.default_rng(0)
    t = TableShard(make_spec(dim=2, capacity=16), 0, 1)
    special = np.array([I64.min, I64.max, 0, -1, 1, I64.min + 1, I64.max - 1], dtype=np.int64)
    all_ids = np.unique(
        np.concatenate([special, rng.integers(I64.min, I64.max, 60000, dtype=np.int64, endpoint=True)])
    )
    all_ids = rng.permutation(all_ids)
    inserted = np.empty(0, dtype=np.int64)
    slots_seen, caps_seen = set(), set()
    for batch in np.array_split(all_ids, [5, 40, 1000, 1001, 9000, 30000]):
        t.apply(batch, np.zeros((batch.size, 2), np.float32), 0.1)
        inserted = np.concatenate([inserted, batch])
        slots_seen.add(t.memory.index_slots)
        caps_seen.add(t.capacity)
        # every id sits at the row it was given (insertion order), nothing else is found
        assert np.array_equal(stored_rows(t, inserted), np.arange(inserted.size))
        unknown = rng.integers(I64.min, I64.max, 2000, dtype=np.int64)
        unknown = unknown[~np.isin(unknown, all_ids)]
        assert (stored_rows(t, unknown) == -1).all()
        assert len(t) == inserted.size
        assert len(t) <= 0.7 * t.memory.index_slots
    assert len(slots_seen) >= 4 and len(caps_seen) >= 4  # grew several times
    # repeated and unordered lookups
    q = rng.choice(inserted, 5000)
    assert np.array_equal(t.memory.ids[stored_rows(t, q)], q)


def colliding_keys(n_slots, home, count, start=0):
    cand = np.arange(start, start + 200000, dtype=np.int64)
    keys = cand[home_slots(cand, n_slots) == home]
    assert keys.size >= count
    return keys[:count]


@pytest.mark.parametrize("home", [3, 15])  # 15: the cluster wraps around to slot 0
def test_index_collisions_within_one_batch(home, index_kind):
    n_slots = 16
    keys = colliding_keys(n_slots, home, 9)
    row_ids = np.empty(32, dtype=np.int64)
    row_ids[:9] = keys
    slots = np.full(n_slots, -1, dtype=np.int32)
    place(slots, home_slots(keys, n_slots), np.arange(9, dtype=np.int32))
    occupied = np.flatnonzero(slots >= 0)
    assert sorted(slots[occupied]) == list(range(9))
    assert sorted(occupied) == sorted((home + np.arange(9)) % n_slots)  # one contiguous cluster
    rows, _ = probe(slots, row_ids, keys, home_slots(keys, n_slots))
    assert np.array_equal(rows, np.arange(9))
    # an absent key with the same home walks the cluster and stops at the first empty slot
    other = colliding_keys(n_slots, home, 1, start=300000)
    rows, stop = probe(slots, row_ids, other, home_slots(other, n_slots))
    assert rows[0] == -1 and stop[0] == (home + 9) % n_slots


def test_index_long_clusters_and_mixed_batch(index_kind):
    # A nearly full tiny index: long clusters exercise the windowed rounds of probe/place.
    n_slots = 1024
    rng = np.random.default_rng(5)
    keys = np.unique(rng.integers(I64.min, I64.max, 1000, dtype=np.int64))[:700]
    row_ids = np.empty(4096, dtype=np.int64)
    row_ids[:700] = keys
    slots = build_index(row_ids, 700, n_slots)
    assert (slots >= 0).sum() == 700
    rows, _ = probe(slots, row_ids, keys, home_slots(keys, n_slots))
    assert np.array_equal(rows, np.arange(700))
    # the table API: a batch mixing stored and new ids, on a tiny table
    t = TableShard(make_spec(dim=1, capacity=1), 0, 1)
    a = np.arange(0, 50, dtype=np.int64)
    t.apply(a, np.ones((50, 1), np.float32), 1.0)
    b = np.arange(25, 100, dtype=np.int64)
    t.apply(b, np.ones((75, 1), np.float32), 1.0)
    init = initial_rows(t.spec, np.arange(100))
    touched_twice = (np.arange(100) >= 25) & (np.arange(100) < 50)
    expect = init - np.where(touched_twice, 2, 1)[:, None].astype(np.float32)
    np.testing.assert_allclose(t.lookup(np.arange(100)), expect, rtol=1e-6, atol=1e-6)
    assert len(t) == 100


def test_compiled_and_numpy_index_find_the_same_rows():
    rng = np.random.default_rng(11)
    n_slots = 1 << 12
    keys = np.unique(rng.integers(I64.min, I64.max, 2800, dtype=np.int64))  # load ~0.68: long clusters
    row_ids = keys.copy()
    rows = np.arange(keys.size, dtype=np.int32)
    kernels = id_index.load_kernels()
    compiled, rounds = np.full(n_slots, -1, np.int32), np.full(n_slots, -1, np.int32)
    kernels.place(compiled, home_slots(keys, n_slots), rows)
    id_index.place_rounds(rounds, home_slots(keys, n_slots), rows)
    asked = np.concatenate(
        [rng.permutation(keys)[:1500], rng.integers(I64.min, I64.max, 1500, dtype=np.int64)]
    )
    for slots in (compiled, rounds):
        found_c, stop_c = kernels.probe(slots, row_ids, asked, home_slots(asked, n_slots), True)
        found_r, stop_r = id_index.probe_rounds(slots, row_ids, asked, home_slots(asked, n_slots), True)
        np.testing.assert_array_equal(found_c, found_r)
        np.testing.assert_array_equal(stop_c, stop_r)
        np.testing.assert_array_equal(np.where(found_c >= 0, row_ids[found_c], asked)[:1500], asked[:1500])
        assert (found_c[:1500] >= 0).all()
        # a missing key's probe stops at an empty slot, where an insert puts it
        assert (slots[stop_c[found_c < 0]] == -1).all() and (found_c[1500:] < 0).sum() >= 1490


def test_growable_moves_in_place_or_copies_when_viewed():
    g = Growable(10, (4,), np.float32)
    g.array[:] = np.arange(40, dtype=np.float32).reshape(10, 4)
    m = g._map
    g.grow(30, 10)
    assert g._map is m  # resized in place (mremap)
    assert g.array.shape == (30, 4) and np.array_equal(g.array[:10].ravel(), np.arange(40))
    view = g.array[2:4]  # a view from outside is alive: the map cannot move, we copy
    g.grow(50, 10)
    assert g._map is not m and g.array.shape == (50, 4)
    assert np.array_equal(view.ravel(), np.arange(8, 16)) and np.array_equal(g.array[2:4], view)
    g.grow(20, 50)  # never shrinks
    assert g.array.shape == (50, 4)


def test_lookup_unknown_is_initial_and_not_inserted():
    spec = make_spec(dim=5, optimizer="adam")
    t = TableShard(spec, 0, 1)
    t.apply(np.array([7, 8]), grads_for([7, 8], 5, 0), 0.01)
    ids = np.array([1, 7, 2, 1, I64.min, I64.max, 8, 7], dtype=np.int64)
    out = t.lookup(ids)
    assert out.dtype == np.float32 and out.shape == (8, 5)
    unknown = ~np.isin(ids, [7, 8])
    np.testing.assert_array_equal(out[unknown], initial_rows(spec, ids[unknown]))
    assert not np.allclose(out[~unknown], initial_rows(spec, ids[~unknown]))
    assert len(t) == 2
    assert t.lookup(np.empty(0, np.int64)).shape == (0, 5)
    out[:] = 0  # a new array, not a view of the table
    assert not (t.lookup(np.array([7])) == 0).all()


def test_fresh_rows_fills_what_the_latest_lookups_kept():
    spec = make_spec(dim=3)
    fresh = FreshRows(keep=2, max_rows=4)
    fresh.remember(np.array([9, 4, 9]), initial_rows(spec, np.array([9, 4, 9])))
    fresh.remember(np.array([5, 1, 2, 3, 6]), initial_rows(spec, np.array([5, 1, 2, 3, 6])))  # > max_rows
    fresh.remember(np.array([11]), initial_rows(spec, np.array([11])))
    out = np.zeros((4, 3), np.float32)
    left = fresh.take(np.array([4, 5, 11, 9]), out)
    np.testing.assert_array_equal(left, [1])  # 5 came with a lookup too big to keep
    np.testing.assert_array_equal(out[[0, 2, 3]], initial_rows(spec, np.array([4, 11, 9])))
    np.testing.assert_array_equal(out[1], 0)
    fresh.remember(np.array([12]), initial_rows(spec, np.array([12])))  # keep=2: [9, 4, 9] goes
    np.testing.assert_array_equal(fresh.take(np.array([4, 12]), out[:2]), [0])


@pytest.mark.skipif(id_index.load_kernels() is None, reason="numba is not installed")
@pytest.mark.parametrize(
    "order,dtype",
    [
        ("ascending", np.float32),
        ("shuffled", np.float32),
        ("descending", np.float64),
        ("repeats", np.float32),
    ],
)
def test_fresh_rows_compiled_fill_equals_the_numpy_rounds(order, dtype):
    rng = np.random.default_rng(3)
    fresh = FreshRows(keep=4)
    kept_ids = []
    for _ in range(5):  # keep=4: the first is gone
        ids = rng.integers(-(1 << 62), 1 << 62, size=300)
        ids[:20] = ids[20:40]  # a lookup may carry repeats
        fresh.remember(ids, rng.random((ids.size, 4)).astype(dtype))
        kept_ids.append(ids)
    # Ids from each kept lookup (the dropped one too), the same id in two lookups, and ids never kept.
    want = np.unique(np.concatenate([k[::7] for k in kept_ids] + [rng.integers(0, 1 << 40, size=50)]))
    want = {
        "ascending": want,
        "shuffled": rng.permutation(want),
        "descending": want[::-1],
        "repeats": np.sort(np.concatenate([want, want[::5]])),
    }[order]
    with fresh._lock:
        kept = list(fresh._kept)
    got, expected = np.full((want.size, 4), -1, dtype), np.full((want.size, 4), -1, dtype)
    left = fill_compiled(id_index.load_kernels(), kept, want, got)
    np.testing.assert_array_equal(left, fill_numpy(kept, want, expected))
    np.testing.assert_array_equal(got, expected)
    assert 50 <= left.size < want.size  # some found, the never-kept ones left
    np.testing.assert_array_equal(got[left], -1)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
@pytest.mark.parametrize("init,version", [("normal", 1), ("normal", 2), ("uniform", 2)])
def test_apply_after_lookup_stores_the_same_rows_as_without_it(init, version, compiled):
    """The rows a lookup kept (version 1's normal: FreshRows) or an apply computed again are the same."""
    spec = dataclasses.replace(make_spec(dim=6, optimizer="adagrad", init=init), init_version=version)
    seen, unseen = TableShard(spec, 0, 1), TableShard(spec, 0, 1)
    if not compiled:
        seen.compiled = unseen.compiled = None
    rng = np.random.default_rng(0)
    for step in range(6):
        ids = np.unique(rng.integers(-50, 50, size=40))
        grads = grads_for(ids, 6, step)
        seen.lookup(np.concatenate([ids, ids[:5]]))  # the inserts of this apply reuse its rows
        seen.apply(ids, grads, 0.1)
        unseen.apply(ids, grads, 0.1)
    probe_ids = np.arange(-60, 60)
    np.testing.assert_array_equal(seen.lookup(probe_ids), unseen.lookup(probe_ids))
    assert len(seen) == len(unseen)


def test_apply_checks_and_step_count():
    t = TableShard(make_spec(dim=3), 0, 1)
    with pytest.raises(ValueError, match="gradient is float64"):
        t.apply(np.array([1]), np.zeros((1, 3)), 0.1)
    with pytest.raises(ValueError, match=r"expected float32 \[2, 3\]"):
        t.apply(np.array([1, 2]), np.zeros((1, 3), np.float32), 0.1)
    with pytest.raises(ValueError, match="id 7 appears twice"):
        t.apply(np.array([1, 7, 7]), np.zeros((3, 3), np.float32), 0.1)
    assert t.step == 0 and len(t) == 0
    t.apply(np.empty(0, np.int64), np.empty((0, 3), np.float32), 0.1)
    t.apply(torch.tensor([4, 5]), torch.ones(2, 3), 0.5)  # torch inputs
    assert t.step == 2 and len(t) == 2


def test_check_ids_names_table_shard_and_id():
    t = TableShard(make_spec(name="clicks"), 1, 3)
    ids = np.arange(100, dtype=np.int64)
    t.check_ids(ids[shard_of(ids, 3) == 1])
    bad = ids[shard_of(ids, 3) == 2][0]
    with pytest.raises(ValueError, match=rf"'clicks'.*shard 1 of 3.*id {bad}"):
        t.check_ids(ids)
    TableShard(make_spec(), 0, 1).check_ids(ids)
    with pytest.raises(ValueError, match="not in"):
        TableShard(make_spec(), 3, 3)


# ---------------------------------------------------------------- torch equivalence

OPTIMIZERS = {
    "sgd": ({}, lambda w, lr, kw: torch.optim.SGD([w], lr=lr)),
    "adagrad": (
        {"lr_decay": 0.05, "initial_accumulator_value": 0.3, "eps": 1e-6},
        lambda w, lr, kw: torch.optim.Adagrad([w], lr=lr, **kw),
    ),
    "adam": ({"betas": (0.8, 0.95), "eps": 1e-6}, lambda w, lr, kw: torch.optim.SparseAdam([w], lr=lr, **kw)),
    "adam-defaults": ({}, lambda w, lr, kw: torch.optim.SparseAdam([w], lr=lr)),
    "adagrad-defaults": ({}, lambda w, lr, kw: torch.optim.Adagrad([w], lr=lr)),
}


# float64: the shards' arithmetic is torch's to rounding (2e-15 seen). float32: the same to 1e-5, with
# room on any CPU: the data come from numpy (not torch's CPU-dependent randn), every step is elementwise,
# and the largest gap, sgd's (torch applies an id's 40 duplicate rows one by one, a shard their sum once),
# used 0.26 of the bound with ATen's AVX2 kernels and 0.36 with its default (non-vectorized) ones; the
# adaptive optimizers 0.01.
TOLERANCES = {"float32": dict(rtol=1e-5, atol=1e-6), "float64": FLOAT64_EXACT}


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
@pytest.mark.parametrize("dtype", sorted(TOLERANCES))
@pytest.mark.parametrize("n_shards", [1, 3])
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_matches_torch_sparse_embedding(opt, n_shards, dtype):
    kwargs, build = OPTIMIZERS[opt]
    name = opt.split("-")[0]
    N, dim, steps = 120, 6, 10
    spec = make_spec(dim=dim, optimizer=name, kwargs=kwargs, dtype=dtype, capacity=N)
    tdtype = getattr(torch, dtype)
    emb = torch.nn.Embedding(N, dim, sparse=True).to(tdtype)
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(initial_rows(spec, np.arange(N))))
    opt_t = build(emb.weight, 0.1, kwargs)
    shards = [TableShard(spec, s, n_shards) for s in range(n_shards)]
    rng = np.random.default_rng(11)
    never = np.arange(100, N)  # ids 100.. never appear
    seen = set()
    for step in range(steps):
        lr = 0.1 * 0.8**step  # a schedule: the caller passes each step's rate
        hi = 100 if step % 3 else 20  # some steps touch only a few ids
        ids = rng.integers(0, hi, 40)  # duplicates
        if step % 4 == 1:
            ids[:] = 5  # one id: the other shards see an empty step
        seen.update(ids.tolist())
        target = torch.from_numpy(rng.standard_normal((40, dim))).to(tdtype)
        out = emb(torch.from_numpy(ids))
        out.retain_grad()
        ((out - target) ** 2).sum().backward()
        for g in opt_t.param_groups:
            g["lr"] = lr
        opt_t.step()
        opt_t.zero_grad()
        uids, rows = merge_duplicates(ids, out.grad.detach().numpy())
        owner = shard_of(uids, n_shards)
        for s, t in enumerate(shards):
            t.check_ids(uids[owner == s])
            t.apply(uids[owner == s], rows[owner == s], lr)  # called even with no ids
    got = np.empty((N, dim), dtype=dtype)
    all_ids = np.arange(N)
    owner = shard_of(all_ids, n_shards)
    for s, t in enumerate(shards):
        got[owner == s] = t.lookup(all_ids[owner == s])
    want = emb.weight.detach().numpy()
    np.testing.assert_allclose(got, want, **TOLERANCES[dtype])
    np.testing.assert_array_equal(got[never], initial_rows(spec, never))
    assert sum(len(t) for t in shards) == len(seen)
    assert all(t.step == steps for t in shards)


# ---------------------------------------------------------------- memory


@pytest.mark.parametrize("optimizer,n_state", [("sgd", 0), ("adam", 2)])
def test_bytes_per_row_within_1_5x_raw(optimizer, n_state):
    spec = make_spec(dim=16, optimizer=optimizer, capacity=1000)
    t = TableShard(spec, 0, 1)
    raw = 8 + 16 * 4 * (1 + n_state) + 8  # id, values, state, seen_step
    assert t.raw_bytes_per_row == raw
    rng = np.random.default_rng(2)
    ratios_after_growth = []
    next_id = 0
    for i in range(60):
        m = int(rng.integers(1000, 6000))
        ids = np.arange(next_id, next_id + m, dtype=np.int64)
        next_id += m
        cap, n_slots = t.capacity, t.memory.index_slots
        t.apply(ids, np.zeros((m, 16), np.float32), 0.1)
        ratio = t.nbytes / len(t) / raw
        if t.capacity != cap or t.memory.index_slots != n_slots:
            ratios_after_growth.append(ratio)
        assert ratio <= 1.5, (i, len(t), t.capacity, t.memory.index_slots, ratio)
    assert len(ratios_after_growth) >= 8
    # steady point: updates of stored rows allocate nothing
    before = t.nbytes
    t.apply(np.arange(0, 5000, dtype=np.int64), np.ones((5000, 16), np.float32), 0.1)
    assert t.nbytes == before and t.nbytes / len(t) <= 1.5 * raw


# ---------------------------------------------------------------- merge_duplicates


def test_merge_duplicates_vs_brute_force():
    rng = np.random.default_rng(4)
    ids = rng.integers(-5, 5, 200)
    rows = rng.standard_normal((200, 3))
    u, s = merge_duplicates(ids, rows)
    brute = {int(i): rows[ids == i].sum(axis=0) for i in set(ids.tolist())}
    assert u.tolist() == sorted(brute)
    for i, r in zip(u, s):
        np.testing.assert_allclose(r, brute[int(i)], rtol=1e-12)
    tu, ts = merge_duplicates(ids, torch.from_numpy(rows))
    assert isinstance(ts, torch.Tensor) and np.array_equal(tu, u)
    np.testing.assert_allclose(ts.numpy(), s, rtol=1e-12)
    tu2, _ = merge_duplicates(torch.from_numpy(ids), torch.from_numpy(rows))
    assert isinstance(tu2, torch.Tensor) and np.array_equal(tu2.numpy(), u)
    # unique ids: the very same objects back
    uniq = np.array([5, -3, 9])
    r = np.ones((3, 2))
    a, b = merge_duplicates(uniq, r)
    assert a is uniq and b is r
    tr = torch.ones(3, 2)
    assert merge_duplicates(uniq, tr)[1] is tr
    e = np.empty(0, np.int64)
    assert merge_duplicates(e, np.empty((0, 2)))[0] is e


# ---------------------------------------------------------------- threads


def test_lookups_concurrent_with_growth_see_consistent_rows():
    spec = make_spec(dim=8, capacity=16)
    t = TableShard(spec, 0, 1)
    fixed = np.arange(-50, 0, dtype=np.int64)
    t.apply(fixed, np.ones((50, 8), np.float32), 1.0)
    want = t.lookup(fixed)
    errors = []
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            got = t.lookup(fixed)
            if not np.array_equal(got, want):
                errors.append(got)
                return

    readers = [threading.Thread(target=reader) for _ in range(2)]
    for r in readers:
        r.start()
    try:
        for a in range(0, 60000, 3000):  # many growths of rows and index
            ids = np.arange(a, a + 3000, dtype=np.int64)
            t.apply(ids, np.ones((3000, 8), np.float32), 0.1)
    finally:
        stop.set()
        for r in readers:
            r.join()
    assert not errors
    assert len(t) == 60050
