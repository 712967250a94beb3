"""The compiled kernels give exactly what the numpy definitions give.

An id's initial row must not depend on where it is computed (a lookup, the insert
of a push, a re-admission after eviction, any pserver count), and an id's shard
and home slot must match the trainer's routing: the compiled paths
(:mod:`pserver.tables.index_kernels`) are compared with :func:`transpiler.tables.initial_rows`,
:func:`transpiler.tables.shard_of` and :func:`transpiler.placement.stable_hash_ids`, bit for bit.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pserver.errors import BadRequest
from pserver.tables import id_index
from pserver.tables.fresh import initial_rows_compiled
from pserver.tables.shard import TableShard, initial_rows_into
from tests.helpers.table_specs import make_spec
from transpiler.placement import stable_hash_ids
from transpiler.tables import initial_rows, shard_of

pytestmark = pytest.mark.skipif(id_index.load_kernels() is None, reason="numba is not installed")


def many_ids(n: int = 200_000) -> np.ndarray:
    """Ids over the whole int64 range (negatives, extremes, CTR-style slot << 40 | z) with repeats."""
    rng = np.random.default_rng(11)
    wide = rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, size=n // 2, dtype=np.int64)
    ctr = (rng.integers(0, 26, size=n // 2) << 40) | rng.zipf(1.2, size=n // 2) % (1 << 40)
    edges = np.array([0, 1, -1, 2, np.iinfo(np.int64).min, np.iinfo(np.int64).max, 7, 7], dtype=np.int64)
    return np.concatenate([edges, wide, ctr.astype(np.int64)])


SPECS = {
    "normal float32 dim 16 (job S)": make_spec(dim=16, seed=7),
    "normal, mean and std": dataclasses.replace(
        make_spec(dim=5, seed=123456789), init_kwargs={"mean": 0.25, "std": 0.01}
    ),
    "normal float64": make_spec(dim=3, dtype="float64", seed=2**63 - 1),
    "normal float16": make_spec(dim=8, dtype="float16", seed=0),
    "uniform": dataclasses.replace(make_spec(dim=7, init="uniform"), init_kwargs={"a": -0.5, "b": 0.75}),
    "uniform float64": make_spec(dim=2, init="uniform", dtype="float64"),
    "zeros": make_spec(dim=4, init="zeros"),
    "padding_idx": dataclasses.replace(make_spec(dim=4), padding_idx=7),
    "dim 1": make_spec(dim=1, seed=99),
}


@pytest.mark.parametrize("name", SPECS)
def test_compiled_initial_rows_equal_the_definition(name):
    spec, ids = SPECS[name], many_ids()
    want = initial_rows(spec, ids)
    got = np.full((ids.size, spec.dim), np.nan, dtype=want.dtype)
    assert initial_rows_compiled(spec, ids, got)
    assert got.tobytes() == want.tobytes()
    chunked = initial_rows_into(spec, ids, np.empty_like(want))  # what the shard runs, in chunks
    assert chunked.tobytes() == want.tobytes()


def test_no_ids_give_no_rows():
    spec = make_spec(dim=4)
    out = np.empty((0, 4), np.float32)
    assert initial_rows_compiled(spec, np.empty(0, np.int64), out) and out.shape == (0, 4)


def test_compiled_home_slots_equal_the_hash_s_top_bits():
    ids = many_ids()
    for n_slots in (16, 1 << 10, 1 << 20, 1 << 31):
        want = (stable_hash_ids(ids) >> np.uint64(64 - (n_slots.bit_length() - 1))).view(np.int64)
        assert np.array_equal(id_index.home_slots(ids, n_slots), want)


@pytest.mark.parametrize("n_shards", [2, 3, 7, 64])
def test_compiled_shard_check_agrees_with_shard_of(n_shards):
    ids = many_ids(20_000)
    owner = shard_of(ids, n_shards)
    kernels = id_index.load_kernels()
    for shard in range(min(n_shards, 3)):
        mine = ids[owner == shard]
        assert kernels.first_foreign(mine, np.uint64(n_shards), np.uint64(shard)) == -1
        TableShard(make_spec(), shard, n_shards).check_ids(mine)
        first = int(np.argmax(owner != shard))
        assert kernels.first_foreign(ids, np.uint64(n_shards), np.uint64(shard)) == first
        with pytest.raises(BadRequest, match=f"{int((owner != shard).sum())} of {ids.size} ids"):
            TableShard(make_spec(), shard, n_shards).check_ids(ids)
