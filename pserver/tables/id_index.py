"""The id index of a table shard: open addressing over numpy arrays, compiled or vectorised.

``slots`` (int32, a power-of-two size) holds row numbers, -1 for empty; the key
of row ``r`` is ``ids[r]`` of the shard's int64 id array. Linear probing: an
id's home slot is the HIGH ``log2(S)`` bits of ``stable_hash_ids(id)``; the low
bits decide the shard (``% n_shards``) and are therefore correlated on one
shard. With numba installed, probes and inserts run compiled, one key at a time
(:mod:`pserver.tables.compiled.index_kernels`); without it, as follows, in numpy.
A lookup probes all pending ids of a batch at once per round (gather
slots, gather the ids of the rows they point to, compare) until each hits its
key or an empty slot; rounds, not ids, are the Python loop. Inserting a batch
places the new row numbers at the empty slot each id's probe stopped at; ids of
the batch that land on the same empty slot are resolved by writing all of them
and reading back (exactly one write survives per slot, its owner wins, the
others move on), which needs no sort. Deleting keys (eviction) shifts later entries of
their cluster back (:func:`delete`), so there are no tombstones.
The load factor stays at most :data:`MAX_LOAD` (the owner doubles and rebuilds).
"""

from __future__ import annotations

from typing import Tuple

import numpy as np

from transpiler.placement import stable_hash_ids

MAX_LOAD = 0.7  # index load factor above which the slots double
EMPTY = np.int32(-1)
_CHUNK = 1 << 22  # ids hashed at once when rebuilding: bounds temporaries
_FEW = 512  # below this many pending keys, probe windows of slots per round
_WINDOW = 64  # slots read per pending key and round, then (probe) doubled
_OFFSETS = np.arange(1 << 16, dtype=np.intp)


def slots_for(n_rows: int) -> int:
    """Smallest power of two (at least 16) holding ``n_rows`` at load <= MAX_LOAD."""
    need = max(16, int(np.ceil(n_rows / MAX_LOAD)))
    return 1 << (need - 1).bit_length()


def home_slots(keys: np.ndarray, n_slots: int) -> np.ndarray:
    """Home slot of every key: the top ``log2(n_slots)`` bits of its stable hash, as intp.

    The low bits pick the shard, so they are nearly constant on one shard;
    the high bits are independent of them. Shifting by at least one bit
    leaves the sign bit clear, so the uint64 buffer is reused as int64.
    """
    shift = np.uint64(64 - (n_slots.bit_length() - 1))
    kernels = _compiled((keys, np.int64))
    if kernels is not None:
        return kernels.homes(keys, shift)
    h = stable_hash_ids(keys)
    h >>= shift
    return h.view(np.int64)


_kernels = None


def load_kernels():
    """Load the compiled kernels (:mod:`pserver.tables.compiled.index_kernels`) now; the module, or None
    without numba.

    Loading numba and the cached kernels takes about 0.5 s (the first compile on a machine, about 2 s),
    which processes that never hold a table (most of the test suite's pservers) do not pay: a table shard
    calls this when it is built, before its pserver serves, so no push waits for it.
    """
    global _kernels
    if _kernels is None:
        from .compiled import index_kernels

        _kernels = index_kernels
    return _kernels if _kernels.AVAILABLE else None


def _compiled(*arrays_and_dtypes):
    """The compiled kernels if they take these arrays (numba is there, each has its one dtype), else None."""
    load_kernels()
    if _kernels.AVAILABLE and all(a.dtype == d and a.ndim == 1 for a, d in arrays_and_dtypes):
        return _kernels
    return None


def probe(
    slots: np.ndarray, row_ids: np.ndarray, keys: np.ndarray, pos: np.ndarray, want_stop: bool = True
) -> Tuple[np.ndarray, np.ndarray]:
    """Find ``keys`` in the index: (row of each key or -1, slot where its probe stopped).

    Compiled (:mod:`pserver.tables.compiled.index_kernels`) when numba is installed,
    else :func:`probe_rounds`; the two give the same answer.
    """
    kernels = _compiled((slots, np.int32), (row_ids, np.int64), (keys, np.int64), (pos, np.int64))
    if kernels is not None:
        return kernels.probe(slots, row_ids, keys, pos, want_stop)
    return probe_rounds(slots, row_ids, keys, pos, want_stop)


def probe_rounds(
    slots: np.ndarray, row_ids: np.ndarray, keys: np.ndarray, pos: np.ndarray, want_stop: bool = True
) -> Tuple[np.ndarray, np.ndarray]:
    """:func:`probe` in vectorised numpy rounds: every pending key advances one slot per round.

    ``pos`` (the home slots, intp) is overwritten: with ``want_stop``, for a
    missing key it ends as the first empty slot of its probe sequence, where an
    insert must put it. All pending keys advance one slot per round (two random
    gathers each); a round writes its results for every pending key and
    compacts with one ``flatnonzero`` and ``take`` (cheaper than boolean masks).
    Linear probing's clusters leave a long thin tail, so once few keys are left
    they read windows of 64, 128, ... consecutive slots per round instead.
    ``row_ids`` must have at least one element (an empty slot's -1 reads its
    last entry, masked out).
    """
    mask = slots.size - 1
    rows = slots.take(pos)
    pending = row_ids.take(rows) != keys
    pending &= rows >= 0
    idx = np.flatnonzero(pending)
    if idx.size == 0:
        return rows, pos
    p, k = pos.take(idx), keys.take(idx)
    while idx.size > _FEW:
        p += 1
        p &= mask
        r = slots.take(p)
        more = row_ids.take(r) != k
        more &= r >= 0
        rows[idx] = r
        if want_stop:
            pos[idx] = p
        sel = np.flatnonzero(more)
        idx, p, k = idx.take(sel), p.take(sel), k.take(sel)
    w = _WINDOW
    while idx.size:
        win = p[:, None] + _OFFSETS[1 : w + 1]
        win &= mask
        r = slots.take(win)
        stop = row_ids.take(r) == k[:, None]
        stop |= r < 0
        found = stop.any(axis=1)
        at = np.arange(0, idx.size * w, w) + stop.argmax(axis=1)
        at[~found] += w - 1  # not found: remember the window's last slot
        rows[idx] = r.ravel().take(at)
        pos[idx] = win.ravel().take(at)
        sel = np.flatnonzero(~found)
        idx, p, k = idx.take(sel), win[:, -1].take(sel), k.take(sel)
        w = min(2 * w, _OFFSETS.size - 1)
    return rows, pos


def place(slots: np.ndarray, pos: np.ndarray, rownums: np.ndarray) -> None:
    """Insert row numbers of absent, distinct keys into the index, starting at ``pos``.

    Compiled (:mod:`pserver.tables.compiled.index_kernels`) when numba is installed,
    else :func:`place_rounds`. Keys that collide may end in different slots
    in the two, each a valid linear-probing layout: probes find them alike.
    """
    kernels = _compiled((slots, np.int32), (pos, np.int64), (rownums, np.int32))
    if kernels is not None:
        kernels.place(slots, pos, rownums)
    else:
        place_rounds(slots, pos, rownums)


def place_rounds(slots: np.ndarray, pos: np.ndarray, rownums: np.ndarray) -> None:
    """:func:`place` in vectorised numpy rounds.

    ``pos`` is where each key's probe stopped (its home slot, or further along
    if the path was occupied). Per round each pending entry looks for an empty
    slot (its current one; once few entries are left, the first of a window of
    64, as in :func:`probe`) and writes its row number there; reading back
    tells which write survived (one per slot); the losers go on after that
    slot, entries that saw no empty slot after their window.
    """
    mask = slots.size - 1
    p = pos.copy()
    r = rownums
    while p.size:
        if p.size > _FEW:
            w, target = 1, p
            found = slots.take(p) < 0
        else:
            w = _WINDOW
            win = p[:, None] + _OFFSETS[:w]
            win &= mask
            empty = slots.take(win) < 0
            found = empty.any(axis=1)
            target = win.ravel().take(np.arange(0, p.size * w, w) + empty.argmax(axis=1))
        f = np.flatnonzero(found)
        te, re = target.take(f), r.take(f)
        slots[te] = re
        stay = ~found
        stay[f] = slots.take(te) != re
        sel = np.flatnonzero(stay)
        nxt = target + 1 if w == 1 else np.where(found, target + 1, p + w)
        p, r = nxt.take(sel), r.take(sel)
        p &= mask


def delete(slots: np.ndarray, row_ids: np.ndarray, keys: np.ndarray) -> bool:
    """Remove ``keys`` (present, distinct; ``row_ids`` still holding them) from the index in place.

    Compiled backward-shift deletion (no tombstones, so probes stay as short
    as before); returns False, changing nothing, where numba is missing: the
    caller then rebuilds the index (:func:`build_index`) over the rows it keeps.
    """
    kernels = _compiled((slots, np.int32), (row_ids, np.int64), (keys, np.int64))
    if kernels is None:
        return False
    shift = np.uint64(64 - (slots.size.bit_length() - 1))
    found = kernels.delete(slots, row_ids, keys, shift)
    if found != keys.size:
        raise RuntimeError(f"id index: {keys.size - found} of {keys.size} keys to delete were not in it")
    return True


def build_index(row_ids: np.ndarray, n: int, n_slots: int) -> np.ndarray:
    """A fresh index of ``n_slots`` slots over rows ``[0, n)`` with keys ``row_ids[:n]``."""
    slots = np.full(n_slots, EMPTY, dtype=np.int32)
    for a in range(0, n, _CHUNK):
        b = min(n, a + _CHUNK)
        place(slots, home_slots(row_ids[a:b], n_slots), np.arange(a, b, dtype=np.int32))
    return slots
