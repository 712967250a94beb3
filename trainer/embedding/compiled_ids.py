"""The numba kernels of :mod:`.id_kernels`: a batch's distinct ids by a hash set, sorted by a radix sort, and
the route by a counting sort. Module-level functions, so that numba's on-disk cache serves every process after
the first (a closure's cache misses: 3 s of compiling per trainer). Importing this imports numba (ImportError
without it).
"""

from __future__ import annotations

import numba
import numpy as np

from transpiler import row_init, tables

_mix = numba.njit("uint64(uint64)", cache=True, nogil=True)(row_init.mix)
_GOLDEN = row_init.GOLDEN


@numba.njit("Tuple((int64[:], int64[:], int64[:]))(int64[:])", cache=True, nogil=True)
def distinct(ids):  # pragma: no cover - compiled
    """(the distinct ids in order of first appearance, each id's slot, the slots' keys): a hash set."""
    n = ids.size
    size = 16
    while size < 2 * n:
        size <<= 1
    mask = np.uint64(size - 1)
    keys = np.empty(size, np.int64)
    used = np.zeros(size, np.bool_)
    slot_of = np.empty(n, np.int64)
    found = np.empty(n, np.int64)
    m = 0
    for i in range(n):
        key = ids[i]
        h = np.int64(_mix(np.uint64(key) + _GOLDEN) & mask)
        while used[h] and keys[h] != key:
            h = (h + 1) & (size - 1)
        if not used[h]:
            used[h] = True
            keys[h] = key
            found[m] = key
            m += 1
        slot_of[i] = h
    return found[:m], slot_of, keys


@numba.njit("int64[:](int64[:], int64[:], int64[:])", cache=True, nogil=True)
def inverse_of(unique, slot_of, keys):  # pragma: no cover - compiled
    """Each id's position in ``unique`` (sorted), through the slots :func:`distinct` gave."""
    size = keys.size
    mask = np.uint64(size - 1)
    rank = np.empty(size, np.int64)
    for j in range(unique.size):
        key = unique[j]
        h = np.int64(_mix(np.uint64(key) + _GOLDEN) & mask)
        while keys[h] != key:
            h = (h + 1) & (size - 1)
        rank[h] = j
    inverse = np.empty(slot_of.size, np.int64)
    for i in range(slot_of.size):
        inverse[i] = rank[slot_of[i]]
    return inverse


# transpiler.tables.radix_sort: job S's 6,300 distinct ids a step in about 50 µs, against 142 for numpy's
# comparison sort on the 2-core machine.
radix_sort = numba.njit("Tuple((int64[:], int64[:]))(int64[:], boolean)", cache=True, nogil=True)(
    tables.radix_sort
)


def unique_inverse(ids: np.ndarray):
    """``np.unique(ids, return_inverse=True)`` of 1-D contiguous int64 ``ids``."""
    found, slot_of, keys = distinct(ids)
    unique = radix_sort(found, False)[0]
    return unique, inverse_of(unique, slot_of, keys)


# The table of slot owners is shared and read-only (transpiler.layout.routing.slot_owners).
_OWNERS = numba.types.Array(numba.types.int32, 1, "C", readonly=True)


@numba.njit(
    numba.types.Tuple((numba.types.int64[:], numba.types.int64[:]))(
        numba.types.int64[:], _OWNERS, numba.int64
    ),
    cache=True,
    nogil=True,
)
def route(ids, owners, n_pservers):  # pragma: no cover - compiled
    """(order, bounds) of :func:`trainer.embedding.id_kernels.route`: a stable counting sort by pserver, the
    pserver of an id the owner of its slot (``owners.size`` a power of two)."""
    shards = np.empty(ids.size, np.int64)
    bounds = np.zeros(n_pservers + 1, np.int64)
    mask = np.uint64(owners.size - 1)
    for i in range(ids.size):
        s = np.int64(owners[_mix(np.uint64(ids[i]) + _GOLDEN) & mask])
        shards[i] = s
        bounds[s + 1] += 1
    for k in range(n_pservers):
        bounds[k + 1] += bounds[k]
    at = bounds[:n_pservers].copy()
    order = np.empty(ids.size, np.int64)
    for i in range(ids.size):
        s = shards[i]
        order[at[s]] = i
        at[s] += 1
    return order, bounds
