"""Initial rows a lookup computed, kept for the insert that usually follows it.

A trainer's step looks up the rows of its next batch and, one step later, pushes their
gradients; ids not stored yet get their initial value (``initial_rows``) at the lookup and
again when the push inserts them. On a CTR stream about a third of a batch's ids are new, and
computing their initial rows is a third of a push's table work; keeping the rows the latest
lookups computed halves that. Initial rows are a pure function of (table seed, id), so a kept
row is the very value a recomputation gives.

Kept rows serve version 1's ``normal`` rows (numpy's ``log`` and ``cos``, the dearest) and every
row of a table with a lifecycle; a plain table computes its other rows again in the apply's kernel
(:mod:`pserver.tables.compiled.row_kernels`).

:func:`initial_rows_compiled` computes them as :func:`transpiler.tables.initial_rows` defines
them, bit for bit: ``uniform``, ``zeros`` and version 2's ``normal`` wholly compiled; version 1's
``normal`` at about 3/4 of the numpy definition's CPU, the splitmix64 hashing compiled
(:mod:`pserver.tables.compiled.index_kernels`), the float64 ``log``, ``sqrt`` and ``cos`` numpy's own (the
very loops the definition runs, so no libm can differ), in place, without temporaries.
"""

from __future__ import annotations

import collections
import math
import threading
from typing import Deque, Tuple

import numpy as np

from transpiler.row_init import COLUMN as _COLUMN
from transpiler.tables import TableSpec, initial_rows

from . import id_index

_CHUNK_VALUES = 1 << 16  # values of initial rows computed at once (see initial_rows_into)
_ALL = np.empty(0, np.int64)


def initial_rows_into(spec: TableSpec, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out[:] = initial_rows(spec, ids)``, computed in chunks of about 64k values.

    ``initial_rows`` makes several float64/uint64 temporaries of the size of
    its output; chunks keep them in cache and small: 1M rows of dim 16 take
    ~0.4 s instead of ~2 s, and no ~0.6 GB transient. Compiled where numba is
    installed (:func:`initial_rows_compiled`, the same values).
    """
    step = max(256, _CHUNK_VALUES // max(1, spec.dim))
    for a in range(0, ids.size, step):
        if not initial_rows_compiled(spec, ids[a : a + step], out[a : a + step]):
            out[a : a + step] = initial_rows(spec, ids[a : a + step])
    return out


def initial_rows_compiled(spec: TableSpec, ids: np.ndarray, out: np.ndarray) -> bool:
    """``out[:] = initial_rows(spec, ids)`` (``out``: (len(ids), dim) of the table's dtype); False where
    numba is missing.

    ``uniform``, ``zeros`` and version 2's ``normal`` run wholly compiled
    (:func:`pserver.tables.compiled.init_kernels.init_rows`). Version 1's ``normal``: every step is the
    definition's own operation on the same float64 values (products commuted, which IEEE arithmetic leaves
    exact), so the rows are identical; ``tests/tables/test_initial_rows.py`` compares them on many ids.
    """
    kernels = id_index.load_kernels()
    if kernels is None:
        return False
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    if spec.init == "zeros" or ids.size == 0:
        out[...] = 0
        return True
    if spec.init == "uniform" or spec.init_version == 2:
        from .compiled import init_kernels

        direct = out.flags.c_contiguous and out.dtype in (np.float32, np.float64)
        into = out if direct else np.empty(out.shape, np.float64)  # one rounding to out's dtype, as numpy's
        init_kernels.init_rows(ids, _ALL, -1, init_kernels.init_params(spec), into)
        if into is not out:
            out[...] = into
        return True
    u1 = np.empty((ids.size, spec.dim), np.float64)
    u2 = np.empty_like(u1)
    cols = np.arange(1, spec.dim + 1, dtype=np.uint64) * _COLUMN
    kernels.row_uniforms(ids.view(np.uint64), np.uint64(spec.seed), cols, u1, u2, True)
    kw = spec.init_kwargs  # mean + std * (sqrt(-2.0 * log(u1)) * cos((2.0 * pi) * u2))
    np.log(u1, out=u1)
    np.multiply(u1, -2.0, out=u1)
    np.sqrt(u1, out=u1)
    np.multiply(u2, 2.0 * math.pi, out=u2)
    np.cos(u2, out=u2)
    np.multiply(u1, u2, out=u1)
    np.multiply(u1, kw["std"], out=u1)
    np.add(u1, kw["mean"], out=u1)
    np.copyto(out, u1, casting="unsafe")
    if spec.padding_idx is not None:
        out[ids == spec.padding_idx] = 0
    return True


class FreshRows:
    """The initial rows of the ids the latest ``keep`` lookups missed, looked up by id.

    A lookup that missed more than ``max_rows`` ids (an evaluation pass, say) is not kept,
    which bounds the memory to ``keep * max_rows`` rows. Thread-safe.
    """

    def __init__(self, keep: int = 4, max_rows: int = 1 << 16):
        self.max_rows = max_rows
        self._kept: Deque[Tuple[np.ndarray, np.ndarray]] = collections.deque(maxlen=keep)
        self._lock = threading.Lock()

    def remember(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Keep ``rows``, the initial rows of ``ids`` (1-D int64, repeats allowed), replacing the oldest."""
        if ids.size == 0 or ids.size > self.max_rows:
            return
        order = np.argsort(ids, kind="stable")
        entry = (ids[order], rows[order])
        with self._lock:
            self._kept.append(entry)

    def take(self, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Fill ``out[i]`` with the kept row of ``ids[i]`` where one is kept; return the indices of the
        others."""
        with self._lock:
            kept = list(self._kept)
        kernels = id_index.load_kernels()
        if kernels is not None and ids.dtype == np.int64 and out.dtype in (np.float32, np.float64):
            return fill_compiled(kernels, kept, ids, out)
        return fill_numpy(kept, ids, out)


def fill_compiled(kernels, kept, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
    """:meth:`FreshRows.take` over ``kept`` ((sorted ids, rows), oldest first), one compiled merge walk per
    entry.

    The walk needs the ids in ascending order; a push's new ids usually come so, others are argsorted. For
    job S's ~950 new ids per push against 4 kept lookups, the numpy rounds of :func:`fill_numpy` take
    0.09-0.27 ms, this 0.03-0.06 (benchmarks/results/RESULTS.md).
    """
    ids = np.ascontiguousarray(ids)
    ascending = ids.size < 2 or bool((ids[1:] >= ids[:-1]).all())
    left = np.arange(ids.size) if ascending else np.argsort(ids, kind="stable")
    n = left.size
    for known, rows in reversed(kept):
        if n == 0:
            break
        n = kernels.copy_known(known, rows, ids, left, n, out)
    return left[:n] if ascending else np.sort(left[:n])


def fill_numpy(kept, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
    """:func:`fill_compiled` in numpy rounds (without numba): the same rows, the same indices left."""
    left = np.arange(ids.size)
    for known, rows in reversed(kept):
        if left.size == 0:
            break
        want = ids[left]
        at = np.searchsorted(known, want)
        np.minimum(at, known.size - 1, out=at)
        hit = known[at] == want
        out[left[hit]] = rows[at[hit]]
        left = left[~hit]
    return left
