"""Admission: which pending ids (holding no row) earn a row, counted in bounded memory.

The rule is :mod:`transpiler.lifecycle`'s: an id is admitted in the step its
count of steps-with-a-gradient reaches ``admit_count``, and only if it passes
the probability test, a pure function of (table seed, id). Counts of pending
ids live in a count-min sketch with conservative update (Estan and Varghese):
4 rows of ``width`` uint16 counters, an id's count the minimum of its 4
counters. A collision can only raise an estimate, so an id is never admitted
late, only sometimes early: with ``k`` distinct pending ids on a shard the
chance that an id seen fewer than ``n`` times reads as ``n`` is at most about
``(k * n / width) ** 4`` for plain updates and lower for conservative ones
(``benchmarks/bench_lifecycle.py`` measures it). Why a sketch and not a
counting Bloom filter: the same memory bound, and it gives a count rather
than a yes/no, so the admission threshold is any ``n``.
"""

from __future__ import annotations

from typing import Dict

import numpy as np

from transpiler.lifecycle import TableLifecycle
from transpiler.placement import stable_hash_ids

DEPTH = 4
# Odd constants that make the 4 row hashes (and the probability hash) independent of each other
# and of the hash that places an id on its shard.
_SALTS = np.array(
    [0x243F6A8885A308D3, 0x13198A2E03707344, 0xA4093822299F31D0, 0x082EFA98EC4E6C89, 0x452821E638D01377],
    dtype=np.uint64,
)


def admissible(ids: np.ndarray, seed: int, probability: float) -> np.ndarray:
    """Whether each id may ever be admitted: ``u(seed, id) < probability`` (bool, per id).

    ``u`` is the top 53 bits of a splitmix64 hash of (seed, id) as a float in
    [0, 1): a pure function, so an id gets the same answer on every pserver,
    in every process and in any order.
    """
    if probability >= 1.0:
        return np.ones(ids.size, dtype=bool)
    with np.errstate(over="ignore"):
        x = stable_hash_ids(ids.view(np.int64) ^ np.int64(seed & 0x7FFFFFFFFFFFFFFF)) ^ _SALTS[4]
        u = (stable_hash_ids(x.view(np.int64)) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
    return u < probability


class CountSketch:
    """Counts of pending ids: a 4 x ``width`` count-min sketch of saturating uint16 counters."""

    def __init__(self, width: int):
        if width < 64 or width & (width - 1):
            raise ValueError(f"sketch width {width} must be a power of two >= 64")
        self.width = width
        self.counters = np.zeros((DEPTH, width), dtype=np.uint16)
        self._shift = np.uint64(64 - (width.bit_length() - 1))
        self._rows = np.arange(DEPTH)[:, None] * width

    @property
    def nbytes(self) -> int:
        return self.counters.nbytes

    def _cells(self, ids: np.ndarray) -> np.ndarray:
        """Flat counter positions (DEPTH, len(ids)) of ``ids``: the top bits of 4 salted hashes."""
        cells = np.empty((DEPTH, ids.size), dtype=np.int64)
        with np.errstate(over="ignore"):
            for d in range(DEPTH):
                h = stable_hash_ids((ids.view(np.uint64) ^ _SALTS[d]).view(np.int64))
                cells[d] = (h >> self._shift).view(np.int64)
        cells += self._rows
        return cells

    def count(self, ids: np.ndarray) -> np.ndarray:
        """Estimated counts of ``ids`` (int64), as int64; no update."""
        return self.counters.reshape(-1)[self._cells(ids)].min(axis=0).astype(np.int64)

    def add(self, ids: np.ndarray) -> np.ndarray:
        """Count one more step for each of ``ids`` (distinct) and return their new estimates.

        Conservative update: each of an id's counters rises only to its new
        estimate (the old minimum plus one), never past it, which keeps the
        over-count of colliding ids small. Ids of one batch that share a
        counter both see it rise, as they would in turn.
        """
        flat = self.counters.reshape(-1)
        cells = self._cells(ids)
        new = np.minimum(flat[cells].min(axis=0).astype(np.int64) + 1, np.iinfo(np.uint16).max)
        np.maximum.at(
            flat, cells.reshape(-1), np.broadcast_to(new.astype(np.uint16), cells.shape).reshape(-1)
        )
        return new

    def halve(self) -> None:
        """Halve every count (rounding down): old occurrences weigh less (``admit_decay_steps``)."""
        self.counters >>= 1

    def state(self) -> Dict[str, np.ndarray]:
        return {"sketch": self.counters}

    def merge_saved(self, counters: np.ndarray) -> None:
        """Add a saved sketch of the same width (a re-shard sums the old shards' sketches).

        A sum over shards is the sketch of the union of their streams: every
        id's estimate stays an upper bound of its count.
        """
        if counters.shape != self.counters.shape:
            raise ValueError(
                f"saved admission sketch has shape {list(counters.shape)}, this table's "
                f"is {list(self.counters.shape)} (admit_sketch_width changed?)"
            )
        total = self.counters.astype(np.uint32) + counters
        np.minimum(total, np.iinfo(np.uint16).max, out=total)
        self.counters[...] = total


class Admission:
    """A table shard's admission rule: the sketch of pending counts plus the probability test."""

    def __init__(self, lifecycle: TableLifecycle, seed: int):
        self.lifecycle = lifecycle
        self.seed = seed
        self.sketch = CountSketch(lifecycle.admit_sketch_width) if lifecycle.admit_count > 1 else None

    def admit(self, ids: np.ndarray) -> np.ndarray:
        """Which pending ``ids`` (distinct) are admitted by this step's gradient (bool per id).

        Counts the step for the admissible ones; ids that fail the probability
        test are never counted (they never get a row).
        """
        ok = admissible(ids, self.seed, self.lifecycle.admit_probability)
        if self.sketch is None:
            return ok
        sel = np.flatnonzero(ok)
        ok[sel] = self.sketch.add(ids[sel]) >= self.lifecycle.admit_count
        return ok

    def end_step(self, step: int) -> None:
        """Apply the count decay due at the end of ``step``."""
        every = self.lifecycle.admit_decay_steps
        if self.sketch is not None and every and step % every == 0:
            self.sketch.halve()
