"""The compiled kernels give exactly what the numpy definitions give; the versions of initial rows.

An id's initial row must not depend on where it is computed (a lookup, the insert
of a push, a re-admission after eviction, any pserver count), and an id's shard
and home slot must match the trainer's routing: the compiled paths
(:mod:`pserver.tables.compiled.index_kernels`, :mod:`pserver.tables.compiled.row_kernels`) are compared with
:func:`transpiler.tables.initial_rows` (both versions), :func:`transpiler.tables.shard_of` and
:func:`transpiler.placement.stable_hash_ids`, bit for bit. Version 1 reads as it always did; version 2
is pinned bit for bit (IEEE arithmetic only, the same on every platform) and draws N(0, 1).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

import numpy as np
import pytest
import torch

from pserver.errors import BadRequest
from pserver.tables import id_index
from pserver.tables.fresh import initial_rows_compiled
from pserver.tables.shard import TableShard, initial_rows_into
from tests.helpers.table_specs import make_spec
from transpiler import row_init
from transpiler.layout.routing import slot_owners
from transpiler.placement import stable_hash_ids
from transpiler.tables import TableSpec, initial_rows, merge_duplicates, shard_of

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


@pytest.mark.parametrize("version", row_init.INIT_VERSIONS)
@pytest.mark.parametrize("name", SPECS)
def test_compiled_initial_rows_equal_the_definition(name, version):
    spec, ids = dataclasses.replace(SPECS[name], init_version=version), many_ids()
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
        assert kernels.first_foreign(mine, slot_owners(n_shards), shard) == -1
        TableShard(make_spec(), shard, n_shards).check_ids(mine)
        first = int(np.argmax(owner != shard))
        assert kernels.first_foreign(ids, slot_owners(n_shards), shard) == first
        with pytest.raises(BadRequest, match=f"{int((owner != shard).sum())} of {ids.size} ids"):
            TableShard(make_spec(), shard, n_shards).check_ids(ids)


@pytest.mark.parametrize(
    "ids, n_shards, repeats",
    [
        ([], 2, False),
        ([5], 1, False),
        ([3, 9, 4, 1], 1, False),
        ([3, 9, 3, 1, 9], 1, True),
        (list(range(0, 2000, 7)) * 2, 1, True),
        (list(range(-500, 500)), 1, False),
    ],
)
def test_a_gradient_s_repeated_ids_are_summed_and_distinct_ones_kept_as_the_plain_merge_does(
    ids, n_shards, repeats
):
    ids = np.array(ids, dtype=np.int64)
    rows = torch.arange(ids.size * 3, dtype=torch.float32).reshape(-1, 3)
    got_ids, got_rows = TableShard(make_spec(dim=3), 0, n_shards).merged_gradient(ids, rows)
    want_ids, want_rows = merge_duplicates(ids, rows)
    np.testing.assert_array_equal(got_ids, want_ids)
    torch.testing.assert_close(got_rows, want_rows, rtol=0, atol=0)
    assert (got_rows is rows) == (not repeats)  # distinct ids: the very gradient, no copy
    kernels = id_index.load_kernels()
    assert kernels.foreign_and_repeat(ids, slot_owners(n_shards), 0) == (-1, first_repeat(ids))


def first_repeat(ids) -> int:
    """The plain definition: the index of the first id seen before, -1 if none."""
    seen = set()
    for i, x in enumerate(ids.tolist()):
        if x in seen:
            return i
        seen.add(x)
    return -1


def test_a_gradient_with_an_id_of_another_shard_is_refused_before_its_repeats_are_merged():
    ids = np.unique(many_ids(200))
    owner = shard_of(ids, 2)
    mine = np.concatenate([ids[owner == 0], ids[owner == 0][:3]])
    rows = torch.ones(mine.size, 4)
    merged, _ = TableShard(make_spec(), 0, 2).merged_gradient(mine, rows)
    assert merged.size == mine.size - 3
    with pytest.raises(BadRequest, match=f"1 of {mine.size + 1} ids do not belong to shard 0 of 2"):
        TableShard(make_spec(), 0, 2).merged_gradient(
            np.append(mine, ids[owner == 1][0]), torch.ones(mine.size + 1, 4)
        )


def test_version_1_reads_as_before():
    """Rows of version 1, as the definition gave them before versions (values printed then; libm's log and
    cos may differ in the last bits between platforms)."""
    spec = dataclasses.replace(make_spec(dim=3, dtype="float64", seed=7), init_version=1)
    want = [
        [-1.2517101089281355, 5.3550551291882344e-04, 1.7522425066891595e-01],
        [1.2033221260091309, -5.3545008295796881e-01, 9.3547809908695101e-01],
        [1.6517716136772500, -1.1985298431061839, -2.9024780013629042e-01],
        [7.8086816190539632e-01, -6.4843533008471443e-01, 4.9309416767179298e-01],
    ]
    np.testing.assert_allclose(initial_rows(spec, np.array([0, 1, -1, 2**62])), want, rtol=1e-13)


def test_version_2_is_pinned_bit_for_bit():
    """Version 2 uses only IEEE arithmetic and sqrt: the same bits on every platform, for ever."""
    spec = dataclasses.replace(make_spec(dim=7, dtype="float64", seed=7), init_version=2)
    rows = initial_rows(spec, many_ids(20_000))
    assert hashlib.sha256(rows.tobytes()).hexdigest()[:16] == V2_DIGEST
    head = initial_rows(spec, np.array([0, 1]))
    np.testing.assert_array_equal(
        head[:, :2], [[-1.2517101089281357, -0.30341887842290116], [1.2033221260068032, 0.7444867225551726]]
    )


V2_DIGEST = "bea814507d8b5d91"


def test_version_2_draws_standard_normals():
    """1M draws of version 2 (float64): moments and the Kolmogorov-Smirnov distance to N(0, 1)."""
    spec = dataclasses.replace(make_spec(dim=16, dtype="float64", seed=5), init_version=2)
    z = initial_rows(spec, np.arange(62_500)).ravel()
    n = z.size
    assert n == 1_000_000
    assert abs(z.mean()) < 4 / math.sqrt(n)  # 4 standard errors
    assert abs(z.std() - 1) < 4 * math.sqrt(0.5 / n)
    assert abs(((z - z.mean()) ** 3).mean()) < 4 * math.sqrt(6 / n) and abs(
        (z**4).mean() - 3
    ) < 4 * math.sqrt(96 / n)
    cdf = torch.special.ndtr(torch.from_numpy(np.sort(z))).numpy()
    ks = max((np.arange(1, n + 1) / n - cdf).max(), (cdf - np.arange(n) / n).max())
    assert ks < 1.63 / math.sqrt(n)  # the 1% critical value
    # The pair's two draws (cos and sin of one angle) are uncorrelated.
    pairs = z.reshape(-1, 2)
    assert abs(np.corrcoef(pairs[:, 0], pairs[:, 1])[0, 1]) < 4 / math.sqrt(n / 2)


def test_version_2_is_box_muller_to_1e_10():
    """Against libm's log, cos and sin on the same uniforms: relative to the draw's radius, below 1e-10."""
    rng = np.random.default_rng(2)
    bits1, bits2 = (rng.integers(0, 2**64, size=1_000_000, dtype=np.uint64, endpoint=False) for _ in range(2))
    z_cos, z_sin = row_init.normal_pairs_v2(bits1, bits2)
    u1 = ((bits1 >> np.uint64(11)) + np.uint64(1)).astype(np.float64) / 2**53
    theta = 2 * math.pi * ((bits2 >> np.uint64(11)).astype(np.float64) + 0.5) / 2**53
    r = np.sqrt(-2 * np.log(u1))
    assert np.abs(z_cos - r * np.cos(theta)).max() < 1e-10 * r.max()
    err = np.maximum(np.abs(z_cos - r * np.cos(theta)), np.abs(z_sin - r * np.sin(theta))) / np.maximum(
        r, 1e-300
    )
    assert err.max() < 1e-10


def test_init_version_defaults():
    """New specs are version 2; a spec written without the field (an old plan, shard file, export) is 1."""
    spec = make_spec()
    assert spec.init_version == 2
    old = spec.to_dict()
    del old["init_version"]
    assert TableSpec.from_dict(old).init_version == 1
    assert TableSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ValueError, match="init_version 3"):
        initial_rows(dataclasses.replace(spec, init_version=3), np.arange(3))
