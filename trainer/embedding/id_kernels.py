"""A batch's table ids compiled: deduplicated (``np.unique``'s sorted ids and inverse) and routed to pservers.

Every step a trainer deduplicates the next batch's ids (job S: 13,312 ids, about 6,300 distinct) and
routes the distinct ones to their pservers (``stable_hash_ids(id) % pservers``, stably sorted by
pserver). ``np.unique(..., return_inverse=True)`` sorts all 13,312 with their positions (about 0.8 ms
of CPU per step on the 2-core machine) and the route sorts again (0.3 ms); here a hash set finds the
distinct ids in one pass, only those are sorted (by numpy), and the route is a counting sort, with
the GIL released. Each returns exactly what the numpy definition returns (tests/trainer/test_id_kernels.py).

The kernels load on first use by a batch of at least :data:`MIN_IDS` ids (compiled once per machine,
then read from numba's cache): a process that never sees such a batch does not import numba. Without
numba, :func:`unique_inverse` and :func:`route` are the numpy definitions.
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from transpiler import row_init
from transpiler.tables import shard_of

# Below this many ids the numpy definitions cost less than a kernel call's overhead matters: and small
# batches (tests, evaluation) never load numba.
MIN_IDS = 2048

_kernels = None  # the compiled module, once loaded; False: numba is not installed


def _load():
    global _kernels
    if _kernels is None:
        try:
            import numba
        except ImportError:
            _kernels = False
            return None
        _kernels = _compile(numba)
    return _kernels or None


def _compile(numba):
    mix = numba.njit("uint64(uint64)", inline="always", nogil=True)(row_init.mix)
    golden = row_init.GOLDEN

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
            h = np.int64(mix(np.uint64(key) + golden) & mask)
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
            h = np.int64(mix(np.uint64(key) + golden) & mask)
            while keys[h] != key:
                h = (h + 1) & (size - 1)
            rank[h] = j
        inverse = np.empty(slot_of.size, np.int64)
        for i in range(slot_of.size):
            inverse[i] = rank[slot_of[i]]
        return inverse

    def unique_inverse(ids):
        found, slot_of, keys = distinct(ids)
        unique = np.sort(found)  # numpy's vectorised sort: 3x numba's on job S's 6,300 distinct ids
        return unique, inverse_of(unique, slot_of, keys)

    @numba.njit("Tuple((int64[:], int64[:]))(int64[:], int64)", cache=True, nogil=True)
    def route(ids, n_pservers):  # pragma: no cover - compiled
        shards = np.empty(ids.size, np.int64)
        bounds = np.zeros(n_pservers + 1, np.int64)
        for i in range(ids.size):
            s = np.int64(mix(np.uint64(ids[i]) + golden) % np.uint64(n_pservers))
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

    class Kernels:
        pass

    k = Kernels()
    k.unique_inverse, k.route = unique_inverse, route
    return k


def _kernels_for(ids: np.ndarray):
    if ids.size < MIN_IDS or ids.dtype != np.int64 or ids.ndim != 1:
        return None
    return _load()


def unique_inverse(ids: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """``np.unique(ids, return_inverse=True)`` of 1-D int64 ``ids``, the inverse flat."""
    kernels = _kernels_for(ids)
    if kernels is not None:
        return kernels.unique_inverse(np.ascontiguousarray(ids))
    unique, inverse = np.unique(ids, return_inverse=True)
    return unique, inverse.reshape(-1)


def route(ids: np.ndarray, n_pservers: int) -> Tuple[np.ndarray, np.ndarray]:
    """(order, bounds): ``ids[order[bounds[k]:bounds[k+1]]]`` belong to pserver k (``stable_hash % n``), in
    their order within each pserver."""
    kernels = _kernels_for(ids)
    if kernels is not None:
        return kernels.route(np.ascontiguousarray(ids), n_pservers)
    shards = shard_of(ids, n_pservers)
    order = np.argsort(shards, kind="stable")
    bounds = np.zeros(n_pservers + 1, dtype=np.int64)
    np.cumsum(np.bincount(shards, minlength=n_pservers), out=bounds[1:])
    return order, bounds


def loaded() -> Optional[bool]:
    """Whether the kernels are loaded (None: not tried yet; False: numba is missing)."""
    return None if _kernels is None else bool(_kernels)
