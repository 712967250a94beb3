"""A batch's table ids compiled: deduplicated (``np.unique``'s sorted ids and inverse) and routed to pservers.

Every step a trainer deduplicates the next batch's ids (job S: 13,312 ids, about 6,300 distinct) and
routes the distinct ones to their pservers (:func:`transpiler.layout.routing.owner_of`, stably sorted by
pserver). ``np.unique(..., return_inverse=True)`` sorts all 13,312 with their positions (about 0.8 ms
of CPU per step on the 2-core machine) and the route sorts again (0.3 ms); here a hash set finds the
distinct ids in one pass, only those are sorted (a radix sort), and the route is a counting sort, with
the GIL released. Each returns exactly what the numpy definition returns (tests/trainer/test_id_kernels.py).

The kernels (:mod:`.compiled_ids`) load on first use by a batch of at least :data:`MIN_IDS` ids
(compiled once per machine, then read from numba's cache): a process that never sees such a batch
does not import numba. Without numba, :func:`unique_inverse` and :func:`route` are the numpy
definitions.
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from transpiler.layout.routing import owner_of, slot_owners

# Smaller batches take the numpy definitions: there they cost tens of µs, and the small batches of tests
# and evaluation never load numba (0.8 s a process).
MIN_IDS = 2048

_kernels = None  # the compiled module, once loaded; False: numba is not installed


def _load():
    global _kernels
    if _kernels is None:
        try:
            from . import compiled_ids
        except ImportError:  # numba is not installed
            _kernels = False
            return None
        _kernels = compiled_ids
    return _kernels or None


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
    """(order, bounds): ``ids[order[bounds[k]:bounds[k+1]]]`` belong to pserver k
    (:func:`transpiler.layout.routing.owner_of`), in their order within each pserver."""
    kernels = _kernels_for(ids)
    if kernels is not None:
        return kernels.route(np.ascontiguousarray(ids), slot_owners(n_pservers), n_pservers)
    shards = owner_of(ids, n_pservers)
    order = np.argsort(shards, kind="stable")
    bounds = np.zeros(n_pservers + 1, dtype=np.int64)
    np.cumsum(np.bincount(shards, minlength=n_pservers), out=bounds[1:])
    return order, bounds


def loaded() -> Optional[bool]:
    """Whether the kernels are loaded (None: not tried yet; False: numba is missing)."""
    return None if _kernels is None else bool(_kernels)
