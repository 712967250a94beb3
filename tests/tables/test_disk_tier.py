"""DiskTier (pserver/tables/lifecycle/disk_tier.py): the LMDB store behind a table's disk tier."""

import errno
import os

import lmdb
import numpy as np
import pytest

from pserver.tables.lifecycle.disk_tier import DiskTier, DiskTierFull, _is_disk_full

RB = 48  # record bytes


def _ids(rng, n):
    extremes = np.array([np.iinfo(np.int64).min, np.iinfo(np.int64).max, -1, 0, 1], dtype=np.int64)
    return np.unique(np.concatenate([extremes, rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64)]))


def _records(rng, n, width=RB):
    return rng.integers(0, 256, (n, width), dtype=np.uint8)


@pytest.fixture
def tier(tmp_path):
    t = DiskTier(str(tmp_path / "tier"), RB, max_bytes=1 << 26)
    yield t
    t.close()


def _contents(t):
    """Every (id, record) in the store, sorted by id."""
    chunks = list(t.iter_chunks())
    if not chunks:
        return np.zeros(0, np.int64), np.zeros((0, t.record_bytes), np.uint8)
    ids = np.concatenate([c[0] for c in chunks])
    recs = np.concatenate([c[1] for c in chunks])
    order = np.argsort(ids)
    return ids[order], recs[order]


def test_put_get_round_trip_random_ids_and_extremes(tier):
    rng = np.random.default_rng(0)
    ids = rng.permutation(_ids(rng, 3000))
    recs = _records(rng, len(ids))
    tier.put(ids, recs)
    assert len(tier) == len(ids)
    q = rng.permutation(ids)
    found, got = tier.get(q)
    assert found.all()
    by_id = dict(zip(ids.tolist(), map(bytes, recs)))
    assert [bytes(r) for r in got] == [by_id[i] for i in q.tolist()]
    f1, r1 = tier.get(np.array([np.iinfo(np.int64).min, np.iinfo(np.int64).max]))
    assert f1.all() and bytes(r1[0]) == by_id[-(2**63)] and bytes(r1[1]) == by_id[2**63 - 1]


def test_records_of_any_dtype_are_stored_as_their_bytes(tier):
    rows = np.arange(4 * RB // 4, dtype=np.float32).reshape(4, RB // 4) * 1.5 - 7
    tier.put(np.array([5, -5, 6, -6], dtype=np.int32), rows)
    found, got = tier.get(np.array([6, 5]))
    assert found.all()
    np.testing.assert_array_equal(got.view(np.float32), rows[[2, 0]])
    assert got.flags.writeable


def test_overwrite_and_repeated_ids_in_one_put(tier):
    rng = np.random.default_rng(1)
    ids = _ids(rng, 200)
    old = _records(rng, len(ids))
    tier.put(ids, old)
    new = _records(rng, 50)
    tier.put(ids[:50], new)
    assert len(tier) == len(ids)
    _, got = tier.get(ids)
    np.testing.assert_array_equal(got[:50], new)
    np.testing.assert_array_equal(got[50:], old[50:])
    # Repeated ids in one put: the last one wins.
    a, b = np.full(RB, 1, np.uint8), np.full(RB, 2, np.uint8)
    tier.put(np.array([77, 77]), np.stack([a, b]))
    np.testing.assert_array_equal(tier.get(np.array([77]))[1][0], b)


def test_get_missing_and_repeated_ids(tier):
    rng = np.random.default_rng(2)
    recs = _records(rng, 2)
    tier.put(np.array([10, -20]), recs)
    found, got = tier.get(np.array([10, 11, 10, -20, 11, 2**63 - 1]))
    assert found.tolist() == [True, False, True, True, False, False]
    np.testing.assert_array_equal(got[[0, 2, 3]], recs[[0, 0, 1]])
    assert not got[[1, 4, 5]].any()
    f0, r0 = tier.get(np.zeros(0, np.int64))
    assert f0.shape == (0,) and r0.shape == (0, RB)


def test_pop_returns_and_removes(tier):
    rng = np.random.default_rng(3)
    ids = _ids(rng, 500)
    recs = _records(rng, len(ids))
    tier.put(ids, recs)
    take = np.concatenate([ids[::3], [123456789012345]])  # one id not stored
    assert 123456789012345 not in ids
    found, got = tier.pop(take)
    assert found[:-1].all() and not found[-1] and not got[-1].any()
    np.testing.assert_array_equal(got[:-1], recs[::3])
    assert len(tier) == len(ids) - len(ids[::3])
    assert not tier.get(ids[::3])[0].any()
    rest = np.setdiff1d(np.arange(len(ids)), np.arange(0, len(ids), 3))
    f2, r2 = tier.get(ids[rest])
    assert f2.all()
    np.testing.assert_array_equal(r2, recs[rest])
    assert not tier.pop(ids[::3])[0].any()  # popped already


def test_delete_counts_what_was_there(tier):
    rng = np.random.default_rng(4)
    ids = _ids(rng, 100)
    tier.put(ids, _records(rng, len(ids)))
    assert tier.delete(np.concatenate([ids[:30], ids[:5], [424242]])) == 30
    assert len(tier) == len(ids) - 30
    assert tier.delete(ids[:30]) == 0
    assert tier.delete(np.zeros(0, np.int64)) == 0


def test_len_and_nbytes_grow(tier):
    rng = np.random.default_rng(5)
    assert len(tier) == 0
    before = tier.nbytes
    assert before > 0
    for k in range(1, 4):
        ids = np.arange(k * 10_000, k * 10_000 + 2000)
        tier.put(ids, _records(rng, len(ids)))
        assert len(tier) == 2000 * k
        assert tier.nbytes > before
        before = tier.nbytes
    assert before >= 6000 * RB


def test_iter_chunks_covers_every_record_once_in_id_order(tier):
    rng = np.random.default_rng(6)
    ids = _ids(rng, 500)
    recs = _records(rng, len(ids))
    shuffle = rng.permutation(len(ids))
    tier.put(ids[shuffle], recs[shuffle])
    chunks = list(tier.iter_chunks(chunk=7))
    assert all(0 < len(c[0]) <= 7 and c[1].shape == (len(c[0]), RB) for c in chunks)
    got_ids = np.concatenate([c[0] for c in chunks])
    assert got_ids.dtype == np.int64
    np.testing.assert_array_equal(got_ids, ids)  # ids from np.unique: sorted, each once
    np.testing.assert_array_equal(np.concatenate([c[1] for c in chunks]), recs)
    assert next(tier.iter_chunks())[0].tolist() == ids.tolist()  # default chunk: all in one
    with pytest.raises(ValueError, match="chunk"):
        tier.iter_chunks(chunk=0)


def test_iter_chunks_reads_one_snapshot_while_writes_go_on(tier):
    rng = np.random.default_rng(7)
    ids = np.arange(1000, dtype=np.int64)
    recs = _records(rng, 1000)
    tier.put(ids, recs)
    it = tier.iter_chunks(chunk=100)
    first_ids, first = next(it)
    # Writes between chunks: the iterator must neither see them nor read recycled pages.
    tier.delete(ids[500:])
    tier.put(ids[:500], _records(rng, 500))
    tier.put(np.arange(5000, 7000), _records(rng, 2000))
    rest = list(it)
    seen = np.concatenate([first_ids] + [c[0] for c in rest])
    np.testing.assert_array_equal(seen, ids)
    np.testing.assert_array_equal(np.concatenate([first] + [c[1] for c in rest]), recs)
    assert len(tier) == 2500


def test_a_new_tier_on_the_same_directory_starts_empty(tmp_path):
    d = tmp_path / "tier"
    d.mkdir()
    (d / "notes.txt").write_text("not the store's")
    env = lmdb.open(str(d), map_size=1 << 20)  # a store left by a previous run
    with env.begin(write=True) as txn:
        txn.put((7).to_bytes(8, "big"), b"x" * RB)
    env.close()
    t = DiskTier(str(d), RB)
    try:
        assert len(t) == 0
        assert not t.get(np.array([7, 0]))[0].any()
        assert list(t.iter_chunks()) == []
        assert (d / "notes.txt").read_text() == "not the store's"
    finally:
        t.close()


def test_full_store_refuses_the_put_and_keeps_its_contents(tmp_path):
    d = str(tmp_path / "tiny")
    t = DiskTier(d, 128, max_bytes=64 << 10)
    rng = np.random.default_rng(8)
    ids = np.array([-3, -7, 2**62, -(2**62)], dtype=np.int64)  # outside the arange()s below
    recs = _records(rng, 4, 128)
    t.put(ids, recs)
    before_ids, before = _contents(t)
    with pytest.raises(DiskTierFull) as exc:  # overwrites included: nothing of the batch may land
        t.put(np.concatenate([ids, np.arange(2000)]), _records(rng, 2004, 128))
    msg = str(exc.value)
    assert d in msg and "max_bytes" in msg and "Free disk space" in msg and "B live" in msg
    assert not isinstance(exc.value, OSError)
    assert len(t) == 4
    found, got = t.get(ids)
    assert found.all()
    np.testing.assert_array_equal(got, recs)
    after_ids, after = _contents(t)
    np.testing.assert_array_equal(after_ids, before_ids)
    np.testing.assert_array_equal(after, before)
    # Filled as far as it goes, the store can still give records back (pop) and take small puts.
    n = 0
    while True:
        try:
            t.put(np.arange(n, n + 20), _records(rng, 20, 128))
        except DiskTierFull:
            break
        n += 20
    assert len(t) == 4 + n and n > 0
    found, _ = t.pop(np.arange(n))
    assert found.all() and len(t) == 4
    t.put(np.arange(20), _records(rng, 20, 128))
    t.close()


def test_map_full_while_a_snapshot_pins_pages(tmp_path):
    # An open iter_chunks keeps old pages alive, so overwrites grow the file until LMDB's map is full.
    t = DiskTier(str(tmp_path / "pinned"), 128, max_bytes=256 << 10)
    rng = np.random.default_rng(9)
    ids = np.arange(300)
    t.put(ids, _records(rng, 300, 128))
    it = t.iter_chunks(chunk=10)
    next(it)
    last = None
    with pytest.raises(DiskTierFull, match="LMDB map"):
        for _ in range(100):
            recs = _records(rng, 300, 128)
            t.put(ids, recs)
            last = recs
    assert last is not None
    np.testing.assert_array_equal(t.get(ids)[1], last)
    assert len(t) == 300
    it.close()  # releases the snapshot: its pages are free again
    t.put(ids, _records(rng, 300, 128))
    t.close()


def test_disk_full_errors_are_recognised(tmp_path):
    assert _is_disk_full(lmdb.DiskError("mdb_txn_commit", errno.ENOSPC), str(tmp_path), 0)
    assert _is_disk_full(OSError(errno.ENOSPC, "No space left on device"), str(tmp_path), 0)
    # LMDB reports a write cut short as EIO: disk full only if the disk really is (nearly) out of room.
    eio = lmdb.Error("mdb_txn_commit: Input/output error")
    vfs = os.statvfs(tmp_path)
    assert not _is_disk_full(eio, str(tmp_path), 0) or vfs.f_bavail * vfs.f_frsize < 1 << 20
    assert _is_disk_full(eio, str(tmp_path), vfs.f_bavail * vfs.f_frsize * 2 + (1 << 30))


@pytest.mark.parametrize(
    "bad_ids, bad_records, match",
    [
        (np.arange(3), np.zeros((3, RB + 1), np.uint8), "bytes per row"),
        (np.arange(3), np.zeros((3, RB // 2), np.uint8), "bytes per row"),
        (np.arange(3).reshape(3, 1), np.zeros((3, RB), np.uint8), "1-D integer"),
        (np.arange(3, dtype=np.float64), np.zeros((3, RB), np.uint8), "1-D integer"),
        (np.arange(3), np.zeros((2, RB), np.uint8), "3 rows"),
        (np.arange(3), np.array([[object()] * RB] * 3), "3 rows"),
        (np.array([2**63], dtype=np.uint64), np.zeros((1, RB), np.uint8), "int64"),
    ],
)
def test_bad_input_raises_value_error_and_changes_nothing(tier, bad_ids, bad_records, match):
    rng = np.random.default_rng(10)
    ids = np.array([0, 1, 2, 50], dtype=np.int64)
    recs = _records(rng, 4)
    tier.put(ids, recs)
    with pytest.raises(ValueError, match=match):
        tier.put(bad_ids, bad_records)
    if bad_ids.ndim != 1 or bad_ids.dtype.kind not in "iu" or bad_ids.dtype == np.uint64:
        for op in (tier.get, tier.pop, tier.delete):
            with pytest.raises(ValueError, match=match):
                op(bad_ids)
    assert len(tier) == 4
    found, got = tier.get(ids)
    assert found.all()
    np.testing.assert_array_equal(got, recs)
    with pytest.raises(ValueError):
        DiskTier(str(tier.directory) + "-x", 0)


def test_clear_empties_and_gives_space_back(tier):
    rng = np.random.default_rng(11)
    empty = tier.nbytes
    tier.put(np.arange(5000), _records(rng, 5000))
    assert tier.nbytes > empty
    tier.clear()
    assert len(tier) == 0 and tier.nbytes == empty
    assert not tier.get(np.arange(5000))[0].any()
    tier.put(np.array([9]), _records(rng, 1))
    assert len(tier) == 1


def test_close_removes_the_files_and_is_idempotent(tmp_path):
    d = tmp_path / "tier"
    t = DiskTier(str(d), RB)
    t.put(np.arange(10), np.zeros((10, RB), np.uint8))
    assert (d / "data.mdb").exists() and (d / "lock.mdb").exists()
    t.close()
    assert not (d / "data.mdb").exists() and not (d / "lock.mdb").exists()
    t.close()
    with pytest.raises(ValueError, match="closed"):
        t.get(np.arange(3))
