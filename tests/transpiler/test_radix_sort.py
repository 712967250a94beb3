"""transpiler/tables.py's radix sort against numpy's: ``np.sort`` and ``np.argsort(kind="stable")``,
exactly, as defined (plain Python) and as each side compiles it (the trainer's batch ids, a sync pserver's
step sums)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.table_models import zipf_ids
from transpiler.tables import radix_sort

CASES = {
    "empty": np.array([], np.int64),
    "one": np.array([7], np.int64),
    "extremes": np.array([3, -1, 3, 0, -(2**63), 2**63 - 1, -1], np.int64),
    "low-bytes-shared": np.arange(300, 0, -1, dtype=np.int64) << 40,  # those passes are skipped
    "all-equal": np.full(50, -5, np.int64),  # every pass is skipped
    "zipf": zipf_ids(500, 4),
}
BIG = {"zipf-13k": zipf_ids(13_312, 5), "distinct-reversed": np.unique(zipf_ids(13_312, 6))[::-1].copy()}


def _check(sort, ids: np.ndarray) -> None:
    before = ids.copy()
    keys, order = sort(ids, True)
    assert keys.dtype == np.int64 and order.dtype == np.int64
    assert np.array_equal(keys, np.sort(ids))
    assert np.array_equal(order, np.argsort(ids, kind="stable"))  # equal ids keep their order
    keys_only, none = sort(ids, False)
    assert np.array_equal(keys_only, keys) and none.size == 0
    assert np.array_equal(ids, before)  # the input is left as it was


@pytest.mark.parametrize("name", CASES)
def test_the_definition_is_numpys_sort_and_stable_argsort(name):
    _check(radix_sort, CASES[name])


def _compiled_sorts():
    pytest.importorskip("numba")
    from pserver.tables.compiled import index_kernels
    from trainer.embedding import compiled_ids

    return {"trainer": compiled_ids.radix_sort, "pserver": index_kernels._radix_sort}


@pytest.mark.parametrize("side", ["trainer", "pserver"])
@pytest.mark.parametrize("name", [*CASES, *BIG])
def test_each_side_s_compiled_sort_is_numpys(side, name):
    _check(_compiled_sorts()[side], {**CASES, **BIG}[name])
