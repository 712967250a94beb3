"""Sparse gradients of a sync step merged on arrival: one sum per id, whatever the number of trainers.

A sync pserver applies a table's step with the mean over trainers of their
pushed (unique ids, rows). Keeping every trainer's part until the step
completes would hold K parts (0.22 MB of ids and rows per trainer per pserver
at job S's size, 228 MB at K = 1,024); instead each push is added on arrival
into a per-table accumulator:

- ``keys`` (int64) and ``sums`` (float64 rows, whatever the table's dtype):
  the step's unique ids in order of first arrival, and the sum of their pushed rows;
- an open-addressing index from id to position (:mod:`pserver.tables.id_index`,
  compiled with numba where installed).

**The mean does not depend on the order of arrival.** The sums are float64: float64
addition of float32 values is exact while the magnitudes summed into one element
span less than 2**29 (the sum of their magnitudes below 2**29 times the smallest
nonzero one: float64's significand has 29 bits more than float32's), and exact
sums are the same in every order. Beyond that span only the 53rd bit of a sum may
differ between orders, and the float32 mean (the sum divided by K in float64, then
rounded once to float32) only where that bit decides a rounding tie. With two
trainers the mean equals, bit for bit, the one the pserver computed in float32
before (``fl32(a + b) / 2`` then, ``fl32((a + b) / 2)`` now: halving is exact, so
both round the same value once), except where halving reaches float32's subnormal
range; with one trainer it is the pushed rows. (A float64 table's sums are float64
as before: the order of arrival may change their last bit.)

**Memory a sync step holds** for its sparse pushes, per table on one pserver, with ``U``
the step's distinct ids there and ``C`` the rows allocated (1,024 doubled until ``C >= U``,
so ``C < 2U`` past 1,024): ``C * (8 + dim * 8)`` for ids and float64 sums plus
``4 * slots_for(C)`` (under ``11.5 * C``) for the index, in all under
``C * (20 + dim * 8)`` bytes. Nothing is kept per trainer: ``U`` is at most the sum
of the parts' sizes and at most the rows the step updates, which the table holds anyway.
How ``U`` grows with K depends on how much trainers' ids overlap: on job S's ids (Zipf 1.2,
about 3,090 ids per push per pserver of 2, dim 16) U is 5.5k, 31k, 100k, 316k, 983k at
K = 2, 16, 64, 256, 1,024, so a step holds about 0.81, 4.6, 15, 47, 145 MB (148 bytes per
distinct id, before the doubling slack; float32 sums held 84: 0.46 to 83 MB) where keeping
the parts held 0.45, 3.6, 14, 57, 228 MB. The buffers are reused from step to step (they
stay at the largest step seen); while a push is added its own part (one trainer's) is held too.

The ids come in the order the pserver gave them before merging on arrival
(``np.unique`` + ``index_add_`` of the concatenated parts): order of first arrival
when no id was pushed by two trainers (what the concatenation gave), sorted otherwise
(what ``np.unique`` gave). A first arrival is copied, and where some id was pushed
twice ``+ 0.0`` is added at the end, as the zero-filled sums of ``index_add_`` did
(this only matters for the sign of a zero).

Not thread-safe: the sync engine holds its lock around every call.
"""

from __future__ import annotations

from typing import Dict, Mapping

import numpy as np
import torch

from . import id_index
from .table_set import SparseGrad

_MIN_ROWS = 1024  # rows allocated at first: one small push needs no growth
_COMPILED = (torch.float32, torch.float64)  # row dtypes the compiled accumulate takes


class StepSums:
    """One table's sparse gradient sums of the step in progress (see the module docstring).

    ``dim`` and ``dtype`` (a torch dtype) are the rows' (the sums are float64, the mean ``dtype``);
    nothing is allocated before the first :meth:`add`.
    """

    def __init__(self, dim: int, dtype: torch.dtype):
        self.dim = dim
        self.dtype = dtype
        self.n = 0  # distinct ids of the step so far
        self.parts = 0  # pushes added this step (an empty one counts)
        self.repeated = False  # whether some id was pushed by two trainers this step
        self.keys = np.empty(0, np.int64)
        self.sums = torch.empty((0, dim), dtype=torch.float64)
        self.slots = np.empty(0, np.int32)

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers (kept between steps)."""
        return self.keys.nbytes + self.slots.nbytes + self.sums.numel() * self.sums.element_size()

    def _reserve(self, rows: int) -> None:
        """Room for ``rows`` distinct ids, the index rebuilt at its load bound; keeps what is summed."""
        if rows <= self.keys.size and id_index.slots_for(rows) <= self.slots.size:
            return
        cap = max(_MIN_ROWS, self.keys.size)
        while cap < rows:
            cap *= 2
        if cap > self.keys.size:
            keys = np.empty(cap, np.int64)
            keys[: self.n] = self.keys[: self.n]
            sums = torch.empty((cap, self.dim), dtype=torch.float64)
            sums[: self.n] = self.sums[: self.n]
            self.keys, self.sums = keys, sums
        self.slots = id_index.build_index(self.keys, self.n, id_index.slots_for(cap))

    def add(self, ids: np.ndarray, rows: torch.Tensor) -> None:
        """Add one trainer's part: ``ids`` (1-D int64, no repeats) and their gradient ``rows`` ([len(ids),
        dim])."""
        self.parts += 1
        m = ids.size
        if m == 0:
            return
        self._reserve(self.n + m)
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        kernels = id_index._compiled((ids, np.int64)) if self.dtype in _COMPILED else None
        if kernels is not None:  # one compiled pass: probe, append or add, no temporaries
            shift = np.uint64(64 - (self.slots.size.bit_length() - 1))
            self.n, repeated = kernels.accumulate(
                self.slots,
                self.keys,
                self.n,
                ids,
                rows.detach().contiguous().numpy(),
                self.sums.numpy(),
                shift,
            )
            self.repeated |= repeated
            return
        pos = id_index.home_slots(ids, self.slots.size)
        at, pos = id_index.probe(self.slots, self.keys, ids, pos)
        at = at.astype(np.int64)
        new = np.flatnonzero(at < 0)
        if new.size:
            rownums = np.arange(self.n, self.n + new.size, dtype=np.int32)
            id_index.place(self.slots, pos[new], rownums)
            self.keys[self.n : self.n + new.size] = ids[new]
            at[new] = rownums
        rows = rows.to(torch.float64)
        if new.size == m:  # every id is new this step: copy, as a lone part is taken as is
            self.sums[self.n : self.n + m] = rows
        else:
            self.repeated = True
            old = np.flatnonzero(at < self.n)
            if new.size:
                self.sums[torch.from_numpy(at[new])] = rows[torch.from_numpy(new)]
            self.sums.index_add_(0, torch.from_numpy(at[old]), rows[torch.from_numpy(old)])
        self.n += new.size

    def mean(self, n_trainers: int) -> SparseGrad:
        """(ids, summed rows / ``n_trainers``) of the step, in new arrays (the buffers are reused): divided in
        float64, then rounded once to the rows' dtype."""
        ids, sums = self.keys[: self.n], self.sums[: self.n]
        kernels = id_index._compiled((ids, np.int64)) if self.dtype in _COMPILED else None
        if kernels is not None:  # one compiled pass: 300 -> 100 µs a job S step on the 2-core machine
            out_ids, out = np.empty(self.n, np.int64), torch.empty((self.n, self.dim), dtype=self.dtype)
            kernels.mean(ids, sums.numpy(), n_trainers, self.repeated, out_ids, out.numpy())
            return out_ids, out
        if not self.repeated:
            return ids.copy(), (sums / n_trainers).to(self.dtype)
        order = np.argsort(ids)  # distinct ids: any sort gives np.unique's order
        rows = torch.index_select(sums, 0, torch.from_numpy(order))
        rows.add_(0.0)
        return ids[order], rows.div_(n_trainers).to(self.dtype)

    def clear(self) -> None:
        """Forget the step's sums (the buffers are kept for the next step)."""
        if self.n:
            self.slots.fill(id_index.EMPTY)
        self.n = 0
        self.parts = 0
        self.repeated = False


class SparseSums:
    """Every table's :class:`StepSums` of the step in progress; true while some push was added."""

    def __init__(self):
        self.tables: Dict[str, StepSums] = {}
        self.touched: set = set()

    def __bool__(self) -> bool:
        return bool(self.touched)

    def add(self, parts: Mapping[str, SparseGrad]) -> None:
        """Add one trainer's push: ``{table: (unique ids, rows)}``."""
        for name, (ids, rows) in parts.items():
            acc = self.tables.get(name)
            if acc is None:
                acc = self.tables[name] = StepSums(rows.shape[1], rows.dtype)
            acc.add(ids, rows)
            self.touched.add(name)

    def mean(self, n_trainers: int) -> Dict[str, SparseGrad]:
        """``{table: (ids, mean rows)}`` over ``n_trainers`` for every table some push of the step named."""
        return {name: self.tables[name].mean(n_trainers) for name in self.touched}

    def clear(self) -> None:
        """Drop the step's sums (a step applied, rolled back or replaced by a backup's copy)."""
        for name in self.touched:
            self.tables[name].clear()
        self.touched = set()

    @property
    def nbytes(self) -> int:
        """Bytes the accumulators hold, buffers kept between steps included."""
        return sum(acc.nbytes for acc in self.tables.values())
