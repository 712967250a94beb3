"""A sync step's sparse sums merged on arrival equal the mean of the kept parts, bit for bit.

The reference is the reduction the pserver made before merging on arrival: every
trainer's (ids, rows) kept until the step completed, then concatenated, merged
with ``merge_duplicates`` (``np.unique`` + ``index_add_``) and divided by K; in
float64, then rounded to the rows' dtype (the sums are float64). With one or two
trainers that equals the former reduction in the rows' own dtype, bit for bit; and
the mean does not depend on the order in which the pushes arrive.
"""

from __future__ import annotations

import zlib
from typing import Dict, List

import numpy as np
import pytest
import torch

from pserver.engine.pending import PendingStep
from pserver.tables import id_index
from pserver.tables.step_sums import SparseSums, StepSums
from transpiler.tables import merge_duplicates


def reference_mean(parts: Dict[str, List[tuple]], n_trainers: int, wide: bool = True) -> Dict[str, tuple]:
    """The former ``TableSet.mean_of``: the K parts kept, reduced at the step's end; in float64 (``wide``,
    then rounded to the rows' dtype) or, as it was, in the rows' dtype."""
    merged = {}
    for name, table_parts in parts.items():
        dtype = table_parts[0][1].dtype
        widen = (lambda r: r.to(torch.float64)) if wide else (lambda r: r)  # noqa: E731
        if len(table_parts) == 1:
            ids, rows = table_parts[0][0], widen(table_parts[0][1])
        else:
            ids, rows = merge_duplicates(
                np.concatenate([p[0] for p in table_parts]), torch.cat([widen(p[1]) for p in table_parts])
            )
        merged[name] = (ids, (rows / n_trainers).to(dtype))
    return merged


def random_part(rng, id_range: int, n: int, dim: int, dtype, zeros: float = 0.0):
    """One trainer's push of one table as the pserver receives it: raw ids (repeats) merged as sort_push
    does.

    With ``zeros``, a share of signed zeros and no repeated ids in the push (merging repeats would turn
    every -0.0 of the push into +0.0).
    """
    if zeros:
        ids = rng.choice(2 * id_range, size=n, replace=False).astype(np.int64) - id_range
    else:
        ids = rng.integers(-id_range, id_range, size=n).astype(np.int64)
    rows = torch.from_numpy(rng.standard_normal((n, dim))).to(dtype)
    if zeros:
        hit = torch.from_numpy(rng.random((n, dim)) < zeros)
        signs = torch.from_numpy(rng.random((n, dim)) < 0.5)
        rows[hit & signs] = -0.0
        rows[hit & ~signs] = 0.0
    return merge_duplicates(ids, rows)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (the sign of a zero included)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
    )


# (trainers K, {table: (id range, ids per push, dim, dtype)}, share of zero gradient values, empty pushes)
CASES = {
    "one trainer": (1, {"emb": (1000, 300, 8, torch.float32)}, 0.0, 0),
    "two trainers, disjoint ids likely": (2, {"emb": (1 << 40, 200, 4, torch.float32)}, 0.0, 0),
    "repeats within and across trainers": (4, {"emb": (50, 120, 8, torch.float32)}, 0.0, 0),
    "signed zeros": (3, {"emb": (30, 40, 4, torch.float32)}, 0.8, 0),
    "signed zeros, ids pushed once among repeats": (3, {"emb": (300, 60, 4, torch.float32)}, 0.8, 0),
    "signed zeros, one trainer": (1, {"emb": (30, 40, 4, torch.float32)}, 0.8, 0),
    "several tables and dtypes": (
        5,
        {
            "a": (500, 200, 16, torch.float32),
            "b": (40, 60, 3, torch.float64),
            "c": (1 << 20, 100, 2, torch.float16),
        },
        0.0,
        0,
    ),
    "empty pushes among others": (4, {"emb": (100, 50, 4, torch.float32)}, 0.0, 2),
    "only empty pushes": (3, {"emb": (100, 0, 4, torch.float32)}, 0.0, 0),
    "growth past the first buffers": (8, {"emb": (1 << 30, 3000, 4, torch.float32)}, 0.0, 0),
    "many trainers, hot ids": (64, {"emb": (400, 100, 8, torch.float32)}, 0.0, 0),
}


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled index", "numpy index"])
@pytest.mark.parametrize("case", CASES)
def test_sums_equal_the_mean_of_kept_parts(case, compiled, monkeypatch):
    if not compiled:
        monkeypatch.setattr(id_index, "_compiled", lambda *a: None)
    k, tables, zeros, empty = CASES[case]
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    sums = SparseSums()
    for step in range(3):  # the buffers are reused: later steps start from cleared sums
        kept = {name: [] for name in tables}
        for trainer in range(k):
            push = {}
            for name, (id_range, n, dim, dtype) in tables.items():
                m = 0 if trainer < empty else n
                push[name] = random_part(rng, id_range, m, dim, dtype, zeros)
                kept[name].append(push[name])
            sums.add(push)
        got, want = sums.mean(k), reference_mean(kept, k)
        # One or two trainers: the very mean the table's dtype gave (one rounding each way).
        former = reference_mean(kept, k, wide=False) if k <= 2 else want
        assert got.keys() == want.keys()
        for name in want:
            assert np.array_equal(got[name][0], want[name][0]), f"{case} step {step} {name}: ids differ"
            assert got[name][0].dtype == np.int64
            assert same(got[name][1], want[name][1]), f"{case} step {step} {name}: rows differ"
            assert same(got[name][1], former[name][1]), f"{case} step {step} {name}: rows differ from before"
        sums.clear()
        assert not sums


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled index", "numpy index"])
def test_the_mean_does_not_depend_on_the_order_of_arrival(compiled, monkeypatch):
    """Float32 rows of one id pushed by 64 trainers in 20 orders: one mean; float32 sums in arrival order
    would differ between orders."""
    if not compiled:
        monkeypatch.setattr(id_index, "_compiled", lambda *a: None)
    rng = np.random.default_rng(3)
    k, dim = 64, 16
    parts = [random_part(rng, 40, 30, dim, torch.float32) for _ in range(k)]
    means, narrow = set(), set()
    for _ in range(20):
        order = rng.permutation(k)
        sums = SparseSums()
        for i in order:
            sums.add({"emb": parts[i]})
        ids, rows = sums.mean(k)["emb"]
        means.add((ids.tobytes(), rows.numpy().tobytes()))
        ref = reference_mean({"emb": [parts[i] for i in order]}, k, wide=False)["emb"]
        narrow.add(ref[1].numpy().tobytes())
    assert len(means) == 1
    assert len(narrow) > 1  # what arrival order did to float32 sums


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled index", "numpy index"])
def test_two_trainers_give_the_former_mean_across_magnitudes(compiled, monkeypatch):
    """Two float32 pushes of the same ids, values from 1e-30 to 1e30 and of both signs: the float64 sum
    halved and rounded once is fl32(a + b) / 2, bit for bit."""
    if not compiled:
        monkeypatch.setattr(id_index, "_compiled", lambda *a: None)
    rng = np.random.default_rng(8)
    n, dim = 4000, 8
    ids = np.arange(n, dtype=np.int64)

    def wide_rows():
        sign = rng.choice([-1.0, 1.0], size=(n, dim))
        return torch.from_numpy(sign * 10.0 ** rng.uniform(-30, 30, size=(n, dim))).to(torch.float32)

    a, b = wide_rows(), wide_rows()
    b[: n // 4] = -a[: n // 4]  # exact cancellations
    sums = SparseSums()
    sums.add({"emb": (ids, a)})
    sums.add({"emb": (ids, b)})
    got = sums.mean(2)["emb"][1]
    assert same(got, (a + b) / 2)


def test_a_table_no_push_named_is_absent_and_clear_drops_everything():
    sums = SparseSums()
    rows = torch.ones(3, 2)
    sums.add({"a": (np.array([5, 6, 7]), rows)})
    sums.add({"b": (np.array([6]), torch.ones(1, 2))})
    assert set(sums.mean(2)) == {"a", "b"}
    sums.clear()  # a roll-back: nothing of the step survives
    sums.add({"b": (np.array([9]), torch.full((1, 2), 4.0))})
    got = sums.mean(1)
    assert list(got) == ["b"]
    assert got["b"][0].tolist() == [9] and got["b"][1].tolist() == [[4.0, 4.0]]


def test_the_mean_owns_its_arrays():
    """The apply and a backup's copy may keep the mean: the next step's sums must not write into it."""
    acc = StepSums(2, torch.float32)
    acc.add(np.array([1, 2]), torch.ones(2, 2))
    ids, rows = acc.mean(1)
    acc.clear()
    acc.add(np.array([3, 4]), torch.full((2, 2), 7.0))
    assert ids.tolist() == [1, 2] and rows.tolist() == [[1.0, 1.0], [1.0, 1.0]]


def test_memory_is_bounded_by_distinct_ids_not_trainers():
    """1,024 trainers pushing the same 500 ids hold what one trainer's push does."""
    dim, ids = 16, np.arange(500, dtype=np.int64)
    one, many = StepSums(dim, torch.float32), StepSums(dim, torch.float32)
    one.add(ids, torch.ones(500, dim))
    for _ in range(1024):
        many.add(ids, torch.ones(500, dim))
    assert many.nbytes == one.nbytes
    assert many.n == 500
    assert many.mean(1024)[1].eq(1.0).all()


def test_pending_step_clear_and_apply_drop_the_sparse_sums():
    pending = PendingStep()
    pending.add(0, {}, {"emb": (np.array([1, 2]), torch.ones(2, 4))}, position=None)
    assert pending.sparse_sums
    pending.clear()
    assert not pending.sparse_sums
    pending.add(1, {}, {"emb": (np.array([2, 3]), torch.full((2, 4), 2.0))}, position=None)
    pending.add(2, {}, {"emb": (np.array([3]), torch.full((1, 4), 4.0))}, position=None)
    _, sparse = pending.mean()
    ids, rows = sparse["emb"]
    assert ids.tolist() == [2, 3] and rows[:, 0].tolist() == [1.0, 3.0]
    pending.applied(1)
    assert not pending.sparse_sums
