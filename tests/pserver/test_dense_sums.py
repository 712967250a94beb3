"""A sync step's dense sums (``pserver.flat.DenseSums``): one float64 buffer, merged on arrival.

With two trainers the mean is today's float32 ``(a + b) / 2`` bit for bit; with more it is the float64
sum's mean rounded once, whatever order the pushes come in; blocks no push held are not in the mean.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from pserver.engine.pending import PendingStep
from pserver.flat import DenseSums, FlatGrad, FlatLayout

SHAPES = [("a", (7, 3)), ("b", ()), ("c", (33,)), ("d", (40, 19)), ("e", (16,))]


def sums(dtype: str = "float32") -> DenseSums:
    layout = FlatLayout.of(SHAPES, dtype)
    return DenseSums(layout, [layout.dtype] * len(layout))


def push(layout: FlatLayout, rng: np.random.Generator, wide: bool = False) -> torch.Tensor:
    """A flat gradient: normal values over 1e-3..1e3 (``wide``: also tiny, huge short of overflowing a sum,
    subnormal and -0.0), zero padding."""
    flat = layout.zeros()
    for i in range(len(layout)):
        n = layout.dense.numels[i]
        values = rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)
        if wide:
            values *= 10.0 ** rng.choice([-40, -30, 0, 30, 34], n)
            values[rng.random(n) < 0.1] = -0.0
        layout.flat(i, flat).copy_(torch.from_numpy(values))
    return flat


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.int32 if t.dtype == torch.float32 else torch.int64)


@pytest.mark.parametrize("wide", [False, True], ids=["normal", "wide"])
def test_two_trainers_give_todays_float32_mean_bit_for_bit(wide):
    rng = np.random.default_rng(0)
    s = sums()
    for _ in range(3):  # reused across steps
        a, b = push(s.layout, rng, wide), push(s.layout, rng, wide)
        s.add_flat(a)
        s.add_flat(b)
        mean = s.mean(2)
        assert isinstance(mean, FlatGrad) and len(mean) == len(s.layout)
        today = (a + b) / 2  # the per-block float32 sum, halved
        assert torch.equal(bits(mean.flat), bits(today))
        s.clear()


def test_negative_zero_stays_negative():
    s = sums()
    minus = torch.full((s.layout.numel,), -0.0)
    s.add_flat(minus)
    s.add_flat(minus)
    assert torch.equal(bits(s.mean(2).flat), bits(minus))


@pytest.mark.parametrize("k", [3, 5, 8])
def test_more_trainers_give_the_float64_mean_in_any_order(k):
    rng = np.random.default_rng(k)
    layout = FlatLayout.of(SHAPES, "float32")
    pushes = [push(layout, rng) for _ in range(k)]
    # The float64 sum of these float32 values is exact (their magnitudes span < 2**29): one reference.
    reference = torch.from_numpy(np.stack([p.numpy() for p in pushes]).astype(np.float64).sum(0) / k).float()
    orders = list(itertools.permutations(range(k)))
    for order in [orders[0], orders[-1], *(orders[i] for i in rng.integers(0, len(orders), 4))]:
        s = DenseSums(layout, [torch.float32] * len(layout))
        for i in order:
            s.add_flat(pushes[i])
        assert torch.equal(bits(s.mean(k).flat), bits(reference))
    # Today's float32 sum in arrival order differs from it somewhere (why the sum is float64 now).
    today = pushes[0].clone()
    for p in pushes[1:]:
        today += p
    assert not torch.equal(today / k, reference)


def test_blocks_some_push_lacks_are_summed_from_those_that_have_them():
    s = sums()
    layout = s.layout
    rng = np.random.default_rng(3)
    a, b, c = (push(layout, rng) for _ in range(3))
    only = np.array([True, False, True, False, False])
    nan = torch.full((layout.numel,), float("nan"))
    for i in np.flatnonzero(only):
        layout.flat(int(i), nan).copy_(layout.flat(int(i), c))
    s.add_flat(nan, only)  # absent blocks hold NaN: never read
    s.add_flat(a)
    by_name = {name: layout.view(i, b) for i, name in enumerate(layout.names) if name != "d"}
    s.add(by_name)  # the gRPC path: by block name
    mean = s.mean(3)
    assert sorted(mean) == list(layout.names)
    for i, name in enumerate(layout.names):
        parts = [x for x, has in ((c, only[i]), (a, True), (b, name != "d")) if has]
        expect = torch.from_numpy(sum(layout.flat(i, x).double().numpy() for x in parts) / 3).float()
        assert torch.equal(mean[name].reshape(-1), expect), name


def test_untouched_blocks_are_absent_and_clear_forgets():
    s = sums()
    s.add({"c": torch.ones(33)})
    mean = s.mean(1)
    assert list(mean) == ["c"] and mean.present.tolist() == [False, False, True, False, False]
    s.clear()
    assert not s and s.mean(1) == {}


def test_blocks_of_mixed_dtypes_give_means_by_name():
    layout = FlatLayout.of(SHAPES[:2], "float64")
    s = DenseSums(layout, [torch.float32, torch.float64])
    s.add({"a": torch.full((7, 3), 1.0), "b": torch.tensor(2.0, dtype=torch.float64)})
    s.add({"a": torch.full((7, 3), 2.0)})
    mean = s.mean(2)
    assert mean["a"].dtype == torch.float32 and mean["a"].shape == (7, 3) and mean["a"].eq(1.5).all()
    assert mean["b"].dtype == torch.float64 and mean["b"].item() == 1.0


def test_a_flat_gradient_of_another_size_is_refused():
    s = sums()
    with pytest.raises(ValueError, match="flat gradient"):
        s.add_flat(torch.zeros(s.layout.numel + 1))


def test_pending_step_takes_flat_and_named_pushes():
    layout = FlatLayout.of(SHAPES, "float32")
    pending = PendingStep(DenseSums(layout, [torch.float32] * len(layout)))
    rng = np.random.default_rng(9)
    a, b = push(layout, rng), push(layout, rng)
    pending.add(0, FlatGrad(layout, a), {}, position=None)
    pending.add(1, dict(FlatGrad(layout, b)), {}, position=None)
    assert pending.touched == set(layout.names)
    dense, sparse = pending.mean()
    assert torch.equal(bits(dense.flat), bits((a + b) / 2)) and sparse == {}
    pending.applied(1)
    assert pending.touched == set() and not pending.dense
