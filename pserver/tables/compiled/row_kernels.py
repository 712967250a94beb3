"""A plain table's push work compiled: an apply and a lookup in one call each.

A *plain* table has no lifecycle (no admission, eviction or disk tier): every id it is sent gets a row,
and nothing is decided per row in Python. For such a table :class:`pserver.tables.shard.TableShard`
runs each :meth:`~pserver.tables.shard.TableShard.apply` and lookup as one call into these kernels,
with the GIL released (``nogil``), on the row store's arrays in place:

- :func:`apply`: refuse a batch that repeats an id (a small hash set of its ids), changing nothing;
  find the ids in the index (in rounds, as :func:`pserver.tables.compiled.index_kernels.probe`); insert the
  missing ones (id, index slot, initial row, optimizer state, metadata); run the sparse optimizer on
  each row where it is stored (sgd, adagrad, adam: the operations of :mod:`pserver.tables.sparse_optim`,
  one by one in the table's dtype, so the rows are those of the numpy rules bit for bit); set
  ``seen_step``. Where the arrays lack room for the new rows, or their initial rows are version 1's
  ``normal`` (numpy's ``log`` and ``cos``, which only numpy computes bit for bit), it stops before
  changing anything and says how many are missing: the shard makes room, computes those rows, and
  calls again.
- :func:`lookup`: find, copy the stored rows into the caller's buffer, and list the others; the shard
  computes their initial rows (:func:`pserver.tables.compiled.init_kernels.init_rows`) after releasing
  its lock. The apply that inserts them, usually the next push, computes them again, as one block
  (:func:`~pserver.tables.compiled.init_kernels.init_block`): that costs less than keeping them
  (by 40 µs per push against a cache of 32k rows written by the lookups' kernels and read by the
  applies', by 25-45 µs against the sorted copies that version 1's rows are kept in,
  :class:`~pserver.tables.fresh.FreshRows`, when version 2's rows cost 0.16 µs per row of dim 16;
  staged, they cost about 0.07): memory accesses cost more than version 2's arithmetic.

Both find a batch's rows in passes whose loads do not depend on each other, each pass's cache lines asked
for the pass before, and read the rows asking for the lines of those a few places on (:mod:`.prefetch`):
on a table of millions of rows each is a miss.

The scalars of an update (``-lr``, ``1 - beta``, ...) are computed in Python and rounded to the
table's dtype exactly where the numpy rules round them (``SparseRule.scalars``). The kernels are
compiled for their signatures when a plain table's shard is first built (about 9 s the first time on
a machine, then loaded from numba's cache in well under a second). Without numba :data:`AVAILABLE`
is False and every table takes the numpy path.
"""

from __future__ import annotations

import sys
from typing import Optional

import numpy as np

from . import index_kernels, init_kernels
from .init_kernels import GIVEN, init_params
from .prefetch import AHEAD, BLOCK, prefetch

AVAILABLE = index_kernels.AVAILABLE
numba = index_kernels.numba

# Optimizers (apply's opt) and the statuses apply returns with a value.
SGD, ADAGRAD, ADAM = 0, 1, 2
DONE, NEED, REPEATED = 0, 1, 2
OPTIMIZERS = {"sgd": SGD, "adagrad": ADAGRAD, "adam": ADAM}


if AVAILABLE:
    from numba import types

    _first_repeat, _home = index_kernels._first_repeat, index_kernels._home
    init_block, init_rows = init_kernels.init_block, init_kernels.init_rows

    @numba.njit(inline="always", nogil=True)
    def _find(slots, keys, ids, shift):  # pragma: no cover - compiled
        """(the row of each id, -1 if absent; the slot its probe stopped at): in rounds over the pending ids
        (see index_kernels.probe), the first in blocks whose slots, then ids, are asked for (:mod:`.prefetch`)
        the pass before they are read."""
        mask = slots.size - 1
        m = ids.size
        at = np.empty(m, np.int64)
        rows = np.empty(m, np.int64)
        pending = np.empty(m, np.int64)
        n = 0
        for b in range(0, m, BLOCK):
            e = min(m, b + BLOCK)
            for i in range(b, e):
                p = np.int64(_home(ids[i], shift))
                at[i] = p
                prefetch(slots, p)
            for i in range(b, e):
                r = slots[at[i]]
                rows[i] = r
                if r >= 0:
                    prefetch(keys, r)
            for i in range(b, e):
                r = rows[i]
                if r >= 0 and keys[r] != ids[i]:
                    pending[n] = i
                    n += 1
        while n:
            left = 0
            for t in range(n):
                i = pending[t]
                p = (at[i] + 1) & mask
                at[i] = p
                r = slots[p]
                rows[i] = r
                if r >= 0 and keys[r] != ids[i]:
                    pending[left] = i
                    left += 1
            n = left
        return rows, at

    # Argument groups (tuples): the index (slots, keys, shift), a row store's arrays (values, two state
    # arrays, seen_step), a table's initial rows (init, initf).
    _ro = lambda dt, nd=1: types.Array(dt, nd, "C", readonly=True)  # noqa: E731 - inputs: views of a payload
    _rw = lambda dt, nd=1: types.Array(dt, nd, "C")  # noqa: E731
    _i64, _u64, _f64 = types.int64, types.uint64, types.float64
    _INDEX = types.Tuple([_rw(types.int32), _rw(_i64), _u64])
    _INIT = types.Tuple([_rw(_i64), _rw(_f64)])
    _STORE = {t: types.Tuple([_rw(t, 2), _rw(t, 2), _rw(t, 2), _rw(_i64)]) for t in (types.float32, _f64)}

    def _sigs(make):
        """One signature per table dtype."""
        return [make(t) for t in (types.float32, _f64)]

    @numba.njit(
        _sigs(lambda t: _i64(_INDEX, _rw(t, 2), _ro(_i64), _rw(t, 2), _rw(_i64))),
        cache=True,
        nogil=True,
    )
    def lookup(index, values, ids, out, miss):  # pragma: no cover - compiled
        """``out[i]`` = the stored row of ``ids[i]``; the indices of the ids not stored go into ``miss``, in
        order. Returns how many."""
        rows = _find(index[0], index[1], ids, index[2])[0]
        k = 0
        for i in range(-AHEAD, ids.size):
            if i + AHEAD < ids.size and rows[i + AHEAD] >= 0:  # the row AHEAD on (see .prefetch)
                prefetch(values, rows[i + AHEAD])
            if i < 0:
                continue
            r = rows[i]
            if r >= 0:
                for j in range(out.shape[1]):
                    out[i, j] = values[r, j]
            else:
                miss[k] = i
                k += 1
        return k

    @numba.njit(
        _sigs(
            lambda t: types.UniTuple(_i64, 2)(
                *(_INDEX, _STORE[t], _i64, _i64, _ro(_i64), _ro(t, 2), _rw(t), _i64, _i64),
                *(_INIT, _ro(t, 2), _rw(_i64), types.boolean),
            )
        ),
        cache=True,
        nogil=True,
    )
    def apply(
        index, store, n, room, ids, grads, hyper, opt, step, init, given, at, resume
    ):  # pragma: no cover - compiled
        """One sparse optimizer step on the rows of ``ids`` (see the module docstring); (status, value).

        ``n`` rows are stored, ``room`` may be; ``at`` (len(ids)) receives each id's row (-1: missing);
        ``resume`` skips the search and uses ``at`` as a NEED left it. (REPEATED, i): ``ids[i]`` came
        earlier in the batch. (NEED, k): k ids are missing and either ``n + k > room`` or their rows must
        be ``given`` (k rows, in the order of the ids). Both change nothing. (DONE, rows now stored).
        """
        slots, keys, shift = index
        values, s1, s2, seen = store
        kind, m, dim, mask = init[0][0], ids.size, values.shape[1], slots.size - 1
        if not resume:
            repeat = _first_repeat(ids)
            if repeat >= 0:
                return REPEATED, repeat
            rows = _find(slots, keys, ids, shift)[0]
            for i in range(m):
                at[i] = rows[i]
        missing = 0
        for i in range(m):
            missing += at[i] < 0
        if missing and (n + missing > room or (kind == GIVEN and given.shape[0] != missing)):
            return NEED, missing
        r, g = n, 0
        for i in range(m):  # the new rows: id, slot, given row, state
            if at[i] >= 0:
                continue
            key = ids[i]
            p = np.int64(_home(key, shift))
            while slots[p] >= 0:
                p = (p + 1) & mask
            slots[p] = r
            keys[r] = key
            if kind == GIVEN:
                for j in range(dim):
                    values[r, j] = given[g, j]
                g += 1
            for j in range(dim if opt != SGD else 0):
                s1[r, j] = hyper[4]
            for j in range(dim if opt == ADAM else 0):
                s2[r, j] = hyper[5]
            seen[r] = 0
            at[i] = r
            r += 1
        if kind != GIVEN:  # the new rows are rows n .. r - 1, their ids keys[n:r]: computed as one block
            init_block(keys, n, r, init[0], init[1], values, n)
        for i in range(-AHEAD, m):
            if i + AHEAD < m:  # the row AHEAD on: its value, state and step (see .prefetch)
                ahead = at[i + AHEAD]
                prefetch(values, ahead)
                prefetch(seen, ahead)
                if opt != SGD:
                    prefetch(s1, ahead)
                if opt == ADAM:
                    prefetch(s2, ahead)
            if i < 0:
                continue
            q = at[i]
            if opt == SGD:
                h0 = hyper[0]
                for j in range(dim):
                    values[q, j] = values[q, j] + h0 * grads[i, j]
            elif opt == ADAGRAD:
                eps, nclr = hyper[0], hyper[1]
                for j in range(dim):
                    gj = grads[i, j]
                    s = s1[q, j] + gj * gj
                    s1[q, j] = s
                    values[q, j] = values[q, j] + (gj / (np.sqrt(s) + eps)) * nclr
            else:
                b1, b2, eps, size = hyper[0], hyper[1], hyper[2], hyper[3]
                for j in range(dim):
                    gj = grads[i, j]
                    m_new = s1[q, j] + (gj - s1[q, j]) * b1
                    s1[q, j] = m_new
                    v_new = s2[q, j] + (gj * gj - s2[q, j]) * b2
                    s2[q, j] = v_new
                    values[q, j] = values[q, j] + (m_new / (np.sqrt(v_new) + eps)) * size
            seen[q] = step
        return DONE, r


class CompiledRows:
    """What the kernels need of one plain table: its initial rows' parameters, its optimizer, its dtype.

    ``given``: its initial rows are version 1's normal, which the shard computes (numpy) and passes in.
    """

    def __init__(self, spec, rule):
        self.kernels = sys.modules[__name__]
        self.init = init_params(spec)
        self.given = bool(self.init[0][0] == GIVEN)
        self.opt = OPTIMIZERS[rule.name]
        self.rule = rule
        self.dtype = np.dtype(spec.dtype)
        self.no_rows = np.empty((0, spec.dim), self.dtype)

    def hyper(self, lr: float, step: int) -> np.ndarray:
        """The update's scalars at ``lr`` and table step ``step``, then the state's initial values."""
        return self.rule.scalars(lr, step, self.dtype)

    def fill(self, ids: np.ndarray, miss: np.ndarray, out: np.ndarray) -> None:
        """``out[i]`` = the initial row of ``ids[i]`` for ``i`` in ``miss`` (not ``given``)."""
        init_rows(ids, miss, miss.size, self.init, out)


def compiled_rows(spec, rule) -> Optional[CompiledRows]:
    """The compiled path of a plain table of ``spec`` (optimizer ``rule``); None without numba or for a
    dtype the kernels do not take."""
    if not AVAILABLE or spec.dtype not in ("float32", "float64"):
        return None
    return CompiledRows(spec, rule)
