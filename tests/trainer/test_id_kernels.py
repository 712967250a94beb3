"""trainer/embedding/id_kernels.py against the numpy definitions it replaces: np.unique's sorted ids and
inverse, and the route (stable_hash_ids % pservers, stably sorted by pserver), exactly."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.table_models import zipf_ids
from trainer.embedding import id_kernels
from transpiler.tables import shard_of


@pytest.mark.parametrize("n", [0, 1, 5, id_kernels.MIN_IDS - 1, id_kernels.MIN_IDS, 13_312, 100_000])
@pytest.mark.parametrize("seed", [0, 1])
def test_unique_inverse_is_numpys(n, seed):
    ids = zipf_ids(n, seed)
    unique, inverse = id_kernels.unique_inverse(ids)
    want_unique, want_inverse = np.unique(ids, return_inverse=True)
    assert unique.dtype == np.int64 and inverse.dtype == np.int64
    assert np.array_equal(unique, want_unique)
    assert np.array_equal(inverse, want_inverse.reshape(-1))


@pytest.mark.parametrize("n", [0, 3, id_kernels.MIN_IDS, 13_312])
@pytest.mark.parametrize("pservers", [1, 2, 3, 7])
def test_route_is_the_stable_sort_by_pserver(n, pservers):
    ids = np.unique(zipf_ids(n, pservers))
    order, bounds = id_kernels.route(ids, pservers)
    shards = shard_of(ids, pservers)
    assert np.array_equal(order, np.argsort(shards, kind="stable"))
    want = np.zeros(pservers + 1, np.int64)
    np.cumsum(np.bincount(shards, minlength=pservers), out=want[1:])
    assert np.array_equal(bounds, want)


def test_the_kernels_load_for_a_big_batch_only():
    """A batch under MIN_IDS takes numpy; one at it the kernels (where numba is installed)."""
    id_kernels.unique_inverse(zipf_ids(id_kernels.MIN_IDS, 3))
    assert id_kernels.loaded() is not None
