"""Table specs and gradients for the table shard's unit tests."""

from __future__ import annotations

import numpy as np

from transpiler.tables import TableOptimizerSpec, TableSpec


def make_spec(
    name="emb", dim=4, optimizer="sgd", kwargs=None, dtype="float32", capacity=64, seed=3, init="normal"
):
    """A table spec as the transpiler would make it, with the given optimizer and initial rows."""
    init_kwargs = {"normal": {"mean": 0.0, "std": 1.0}, "uniform": {"a": 0.0, "b": 1.0}, "zeros": {}}[init]
    return TableSpec(
        name=name,
        dim=dim,
        dtype=dtype,
        kind="embedding",
        capacity=capacity,
        seed=seed,
        init=init,
        init_kwargs=init_kwargs,
        optimizer=TableOptimizerSpec(optimizer, dict(kwargs or {})),
    )


def grads_for(ids, dim, seed, dtype=np.float32):
    """Reproducible random row gradients for ``ids``."""
    return np.random.default_rng(seed).standard_normal((len(ids), dim)).astype(dtype)
