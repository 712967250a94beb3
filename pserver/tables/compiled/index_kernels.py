"""The id index's probe and insert compiled with numba, and the other per-id loops of a push.

Besides the index: :func:`homes` (home slots), :func:`first_foreign` (the shard check),
:func:`foreign_and_repeat` (that and an id twice in a batch),
:func:`row_uniforms` (the integer half of an initial row, :mod:`pserver.tables.fresh`),
:func:`copy_known` (kept initial rows found by id, :class:`pserver.tables.fresh.FreshRows`),
:func:`accumulate` and :func:`mean` (a sync step's sums and their mean, :mod:`pserver.tables.step_sums`),
each exactly the numpy formula it replaces (tests/tables/test_initial_rows.py, test_step_sums.py).

:mod:`pserver.tables.id_index` probes a batch in vectorised numpy rounds, a dozen or more numpy
calls and temporaries per round over the keys still pending; compiled, the same rounds are plain
loops, without the GIL (``nogil``), so other handler threads run meanwhile. Inserts walk one key
at a time (new keys of a batch may collide with each other, and are few). numba is a
maintained JIT for exactly such loops over numpy arrays; the kernels are compiled for their one
signature when this module is first imported and cached on disk (``cache=True``), so a
pserver does not compile on its first push.

Without numba (``pip install`` on a platform it has no wheel for), :data:`AVAILABLE` is False
and the index keeps its numpy rounds: the same index, slower.
"""

from __future__ import annotations

import logging

import numpy as np

from transpiler import row_init, tables
from transpiler.row_init import GOLDEN as _GOLDEN

log = logging.getLogger(__name__)

try:
    import numba
except ImportError:  # the numpy rounds of id_index serve instead
    numba = None

AVAILABLE = numba is not None

if AVAILABLE:
    from .prefetch import AHEAD, BLOCK, prefetch

    def _for_rows(signature: str) -> list:
        """``signature`` for rows of either float width: its ``{t}`` as float32, then float64."""
        return [signature.format(t=t) for t in ("float32", "float64")]

    @numba.njit(
        "Tuple((int32[:], int64[:]))(int32[:], int64[:], int64[:], int64[:], boolean)", cache=True, nogil=True
    )
    def probe(slots, row_ids, keys, pos, want_stop):  # pragma: no cover - compiled
        """As :func:`pserver.tables.id_index.probe`: (row of each key or -1, slot its probe stopped at).

        In rounds, as the numpy version: every pending key reads its next slot in one loop and
        compares the id there in another. The iterations of a loop do not depend on each other,
        so the CPU overlaps their cache misses; walking one key's chain to its end before the
        next key's would wait for each miss in turn (3x slower on 100k ids among 10M rows).
        """
        mask = slots.size - 1
        at = pos if want_stop else pos.copy()
        rows = np.empty(keys.size, np.int32)
        pending = np.empty(keys.size, np.int64)
        for i in range(keys.size):
            rows[i] = slots[at[i]]
        n = 0
        for i in range(keys.size):
            r = rows[i]
            if r >= 0 and row_ids[r] != keys[i]:
                pending[n] = i
                n += 1
        while n:
            for j in range(n):
                i = pending[j]
                p = (at[i] + 1) & mask
                at[i] = p
                rows[i] = slots[p]
            left = 0
            for j in range(n):
                i = pending[j]
                r = rows[i]
                if r >= 0 and row_ids[r] != keys[i]:
                    pending[left] = i
                    left += 1
            n = left
        return rows, pos

    @numba.njit("void(int32[:], int64[:], int32[:])", cache=True, nogil=True)
    def place(slots, pos, rownums):  # pragma: no cover - compiled
        """As :func:`pserver.tables.id_index.place`: each row number into the first empty slot from its
        ``pos``."""
        mask = slots.size - 1
        for i in range(pos.size):
            p = pos[i]
            while slots[p] >= 0:
                p = (p + 1) & mask
            slots[p] = rownums[i]

    @numba.njit("uint64(int64, uint64)", cache=True, nogil=True)
    def _home(key, shift):  # pragma: no cover - compiled
        x = np.uint64(key) + np.uint64(0x9E3779B97F4A7C15)
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
        return x >> shift

    @numba.njit("int64(int32[:], int64[:], int64[:], uint64)", cache=True, nogil=True)
    def delete(slots, row_ids, keys, shift):  # pragma: no cover - compiled
        """Remove ``keys`` from the index by backward shift; return how many were found.

        Linear probing needs no tombstones: after emptying slot ``i``, each
        later entry of the cluster whose home is not cyclically in ``(i, j]``
        moves back into the hole, which moves on to ``j``; the cluster ends at
        an empty slot. Each key is found again from its home first, as the
        shifts of earlier keys move entries. ``row_ids`` must still hold the
        keys' ids, and the home is :func:`pserver.tables.id_index.home_slots`'s
        (the top bits of the splitmix64 finaliser, ``shift`` = 64 - log2(slots)), recomputed here.
        """
        mask = slots.size - 1
        found = 0
        for key in keys:
            i = np.int64(_home(key, shift))
            while slots[i] >= 0 and row_ids[slots[i]] != key:
                i = (i + 1) & mask
            if slots[i] < 0:
                continue
            found += 1
            j = i
            while True:
                j = (j + 1) & mask
                r = slots[j]
                if r < 0:
                    break
                k = np.int64(_home(row_ids[r], shift))
                if (i <= j and (k <= i or k > j)) or (i > j and k <= i and k > j):
                    slots[i] = r
                    i = j
            slots[i] = -1
        return found

    _UNIT = 1.0 / (1 << 53)
    # splitmix64's finaliser: the transpiler's own definition (on arrays there), compiled for one value.
    _mix = numba.njit("uint64(uint64)", cache=True, nogil=True)(row_init.mix)

    @numba.njit(
        "void(uint64[:], uint64, uint64[:], float64[:, :], float64[:, :], boolean)", cache=True, nogil=True
    )
    def row_uniforms(ids, seed, cols, u1, u2, both):  # pragma: no cover - compiled
        """The uniforms of :func:`transpiler.tables.initial_rows`, exactly: ``u1`` (and with ``both``,
        ``u2``).

        Per id ``base = mix(id * GOLDEN + seed)``; element j takes the top 53 bits of ``mix(base ^
        cols[j])`` (``u1``) and of ``mix((base + GOLDEN) ^ cols[j])`` (``u2``) as ``(bits + 1) / 2**53``:
        integer arithmetic and exact conversions, so the values are those of the numpy formula bit for bit,
        without its uint64 temporaries.
        """
        for i in range(ids.size):
            base = _mix(ids[i] * _GOLDEN + seed)
            other = base + _GOLDEN
            for j in range(cols.size):
                u1[i, j] = (np.float64(_mix(base ^ cols[j]) >> np.uint64(11)) + 1.0) * _UNIT
                if both:
                    u2[i, j] = (np.float64(_mix(other ^ cols[j]) >> np.uint64(11)) + 1.0) * _UNIT

    @numba.njit(
        _for_rows("int64(int64[:], {t}[:, :], int64[:], int64[:], int64, {t}[:, :])"), cache=True, nogil=True
    )
    def copy_known(known, rows, ids, left, n, out):  # pragma: no cover - compiled
        """One kept lookup's rows into ``out`` (:meth:`pserver.tables.fresh.FreshRows.take`); the ids still
        left.

        ``left[:n]`` are indices into ``ids`` in ascending order of their ids, ``known`` is sorted: one
        merge walk (a binary search per id mispredicts its branches on random ids, 2-4x slower). Where
        ``ids[i] == known[k]``, ``out[i] = rows[k]``; the other indices stay in ``left``, compacted to its
        first entries in the same order, and their count is returned. Copies only: the rows are those kept.
        """
        m = 0
        k = 0
        for t in range(n):
            i = left[t]
            key = ids[i]
            while k < known.size and known[k] < key:
                k += 1
            if k < known.size and known[k] == key:
                for j in range(out.shape[1]):
                    out[i, j] = rows[k, j]
            else:
                left[m] = i
                m += 1
        return m

    # The table of slot owners is shared and read-only (transpiler.layout.routing.slot_owners).
    _OWNERS = numba.types.Array(numba.types.int32, 1, "C", readonly=True)

    @numba.njit(numba.int64(numba.types.int64[:], _OWNERS, numba.int64), cache=True, nogil=True)
    def first_foreign(ids, owners, shard):  # pragma: no cover - compiled
        """Index of the first id whose pserver (``owners`` of its slot,
        :func:`transpiler.layout.routing.owner_of`) is not ``shard``; -1 if none."""
        mask = np.uint64(owners.size - 1)
        for i in range(ids.size):
            if owners[_mix(np.uint64(ids[i]) + _GOLDEN) & mask] != shard:
                return i
        return -1

    @numba.njit(inline="always", nogil=True)
    def _first_repeat(ids):  # pragma: no cover - compiled
        """The index of the first id that came earlier in ``ids``, -1 if none: a small hash set of the ids
        (a few kB, in the core's cache; a sort of them costs several times more). Inlined where it is
        called, for any layout of ``ids`` (the table kernels take read-only views of a payload)."""
        size, bits = 16, 4
        while size < 2 * ids.size:
            size, bits = 2 * size, bits + 1
        seen = np.empty(size, np.int64)
        used = np.zeros(size, np.bool_)
        shift = np.uint64(64 - bits)
        for i in range(ids.size):
            p = np.int64(_home(ids[i], shift))
            while used[p]:
                if seen[p] == ids[i]:
                    return i
                p = (p + 1) & (size - 1)
            used[p] = True
            seen[p] = ids[i]
        return -1

    @numba.njit(
        numba.types.UniTuple(numba.int64, 2)(numba.types.int64[:], _OWNERS, numba.int64),
        cache=True,
        nogil=True,
    )
    def foreign_and_repeat(ids, owners, shard):  # pragma: no cover - compiled
        """(:func:`first_foreign`, the index of the first id that came earlier, -1 if none) of ``ids`` in one
        call; the second is -1 where the first is found."""
        foreign = first_foreign(ids, owners, shard)
        return foreign, (_first_repeat(ids) if foreign < 0 else -1)

    @numba.njit("int64[:](int64[:], uint64)", cache=True, nogil=True)
    def homes(ids, shift):  # pragma: no cover - compiled
        """:func:`pserver.tables.id_index.home_slots` compiled: the top bits of each id's stable hash."""
        out = np.empty(ids.size, np.int64)
        for i in range(ids.size):
            out[i] = np.int64(_home(ids[i], shift))
        return out

    @numba.njit(
        _for_rows(
            "Tuple((int64, boolean))(int32[:], int64[:], int64, int64[:], {t}[:, :], float64[:, :], uint64)"
        ),
        cache=True,
        nogil=True,
    )
    def accumulate(slots, keys, n, ids, rows, sums, shift):  # pragma: no cover - compiled
        """Add ``rows`` into ``sums`` by id (:class:`pserver.tables.step_sums.StepSums`); (distinct ids
        now, any repeat).

        ``keys[:n]`` are the ids summed so far, ``slots`` their index (linear probing from :func:`_home`,
        room for every new id); a new id is appended (its row copied), a known one has its row added
        element by element, in float64 whatever the rows' width (``sums`` is float64).
        """
        mask = slots.size - 1
        repeated = False
        home = np.empty(min(ids.size, BLOCK), np.int64)
        for b in range(0, ids.size, BLOCK):
            e = min(ids.size, b + BLOCK)
            # The block's home slots, then the rows they hold, asked for a pass ahead (see .prefetch): a
            # step of K trainers sums ids in a table too large for the caches.
            for i in range(b, e):
                home[i - b] = np.int64(_home(ids[i], shift))
                prefetch(slots, home[i - b])
            for i in range(b, e):
                r = slots[home[i - b]]
                if r >= 0:
                    prefetch(keys, r)
                    prefetch(sums, r)
            for i in range(b, e):
                key = ids[i]
                p = home[i - b]
                while True:
                    r = slots[p]
                    if r < 0:
                        slots[p] = n
                        keys[n] = key
                        for j in range(rows.shape[1]):
                            sums[n, j] = rows[i, j]
                        n += 1
                        break
                    if keys[r] == key:
                        for j in range(rows.shape[1]):
                            sums[r, j] += rows[i, j]
                        repeated = True
                        break
                    p = (p + 1) & mask
        return n, repeated

    _radix_sort = numba.njit("Tuple((int64[:], int64[:]))(int64[:], boolean)", cache=True, nogil=True)(
        tables.radix_sort
    )

    @numba.njit(
        _for_rows("void(int64[:], float64[:, :], int64, boolean, int64[:], {t}[:, :])"),
        cache=True,
        nogil=True,
    )
    def mean(ids, sums, n_trainers, repeated, out_ids, out):  # pragma: no cover - compiled
        """:meth:`pserver.tables.step_sums.StepSums.mean` in one pass: ``out_ids`` the step's ``ids``, ``out``
        their ``sums`` divided by ``n_trainers`` in float64, then rounded once to ``out``'s dtype.

        Where some id was summed twice (``repeated``), the ids sorted (:func:`transpiler.tables.radix_sort`,
        np.unique's order) and ``+ 0.0`` added before dividing, as the numpy definition does; else in the
        order they came.
        """
        order = _radix_sort(ids, True)[1] if repeated else np.arange(ids.size)
        for j in range(ids.size):
            if repeated and j + AHEAD < ids.size:  # sorted, the sums are read in no order: ask ahead
                prefetch(sums, order[j + AHEAD])
            r = order[j]
            out_ids[j] = ids[r]
            for c in range(sums.shape[1]):
                out[j, c] = ((sums[r, c] + 0.0) if repeated else sums[r, c]) / n_trainers

else:
    log.debug("numba is not installed: the id index probes in numpy rounds")
