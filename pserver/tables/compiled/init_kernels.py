"""Initial rows compiled: ``zeros``, ``uniform`` and version 2's ``normal``, bit for bit the definition's.

:mod:`transpiler.row_init` defines the rows in numpy; these kernels run the same float64 operations in
the same order, so every row is the definition's to the last bit (tests/tables/test_initial_rows.py
compares them on many ids). A plain table's lookup computes the initial rows of the ids it misses, and
the apply that inserts them computes them again (:mod:`.row_kernels`): on job S about a thousand rows
of dim 16 each way per push.

Version 2's ``normal`` is computed in stages over a chunk of rows, so that the arithmetic runs four
float64 lanes at a time (AVX2): the uniform bits of every (row, pair of columns) first (splitmix64),
then the exponent and mantissa of ``u1``'s integer read from its float64's bits (exact: the integer
is below 2**53; the same ``frexp`` the definition takes), then the logarithm, square root, angle and
rotation as branch-free selects over flat arrays. One row at a time with branches and a table lookup
per pair it cost about 0.23 µs per row of dim 16; staged, about 0.07 (job S's 950 new rows a push:
215 -> 64 µs of CPU). ``error_model="numpy"`` lets LLVM vectorize the division (numba's default checks
it for zero, which keeps every loop scalar); nothing here divides by zero (``f + 1 >= 1.5``).
"""

from __future__ import annotations

import numpy as np

from transpiler import row_init as ri

from . import index_kernels

AVAILABLE = index_kernels.AVAILABLE
numba = index_kernels.numba

# Initial-row kinds (init[0]); GIVEN: computed by the caller (version 1's normal) and passed in.
ZEROS, UNIFORM, NORMAL2, GIVEN = 0, 1, 2, 3
CHUNK_ROWS = 256  # rows whose pairs are staged at once: their scratch (about 100 KB at dim 16) stays in cache


def init_params(spec) -> tuple:
    """``(init, initf)``, a table's initial rows as the kernels take them: int64 [kind, seed bits, has
    padding_idx, padding_idx] and float64 [mean, std] (normal) or [a, b - a] (uniform)."""
    kw = spec.init_kwargs
    if spec.init == "zeros":
        kind, f = ZEROS, (0.0, 0.0)
    elif spec.init == "uniform":
        kind, f = UNIFORM, (kw["a"], kw["b"] - kw["a"])
    else:
        kind, f = (NORMAL2 if spec.init_version == 2 else GIVEN), (kw["mean"], kw["std"])
    pad = spec.padding_idx
    seed = np.array([spec.seed], np.uint64).view(np.int64)[0]
    init = np.array([kind, seed, pad is not None, 0 if pad is None else pad], np.int64)
    return init, np.array(f, np.float64)


if AVAILABLE:
    _mix = index_kernels._mix
    _GOLDEN, _COLUMN = ri.GOLDEN, ri.COLUMN
    _UNIT = 1.0 / (1 << 53)
    _L0, _L1, _L2, _L3, _L4 = ri.LOG_SERIES
    _S0, _S1, _S2, _S3, _S4 = ri.SIN_SERIES
    _C0, _C1, _C2, _C3, _C4, _C5 = ri.COS_SERIES
    _SQRT_HALF, _LN2, _ANGLE = ri.SQRT_HALF, ri.LN2, ri.ANGLE_STEP
    _OCTANT, _OCTANT_U = np.int64(ri.OCTANT_BITS), ri.OCTANT_BITS
    _MANTISSA, _HALF = (
        np.uint64((1 << 52) - 1),
        np.uint64(0x3FE << 52),
    )  # a float64's mantissa; 0.5's exponent

    @numba.njit(nogil=True, error_model="numpy")
    def _pair_bits(keys, k0, k1, seed, pairs, q, top):  # pragma: no cover - compiled
        """For rows ``keys[k0:k1]`` and their ``pairs`` column pairs, in row order: ``q`` = u1's integer
        ``(bits1 >> 11) + 1`` as a float64 (exact), ``top`` = ``bits2 >> 11``."""
        for i in range(k0, k1):
            base = _mix(np.uint64(keys[i]) * _GOLDEN + seed)
            other = base + _GOLDEN
            o = (i - k0) * pairs
            for p in range(pairs):
                col = np.uint64(p + 1) * _COLUMN
                q[o + p] = np.float64((_mix(base ^ col) >> np.uint64(11)) + np.uint64(1))
                top[o + p] = _mix(other ^ col) >> np.uint64(11)

    @numba.njit(nogil=True, error_model="numpy")
    def _frexp(q_bits, exponent, m):  # pragma: no cover - compiled
        """``q = f * 2**e`` with f in [0.5, 1) for the first ``m``: f in place of q (its float64's bits), and
        ``e - 53`` as a float64 in ``exponent``."""
        for t in range(m):
            b = q_bits[t]
            exponent[t] = np.float64(np.int64(b >> np.uint64(52)) - (1022 + 53))
            q_bits[t] = (b & _MANTISSA) | _HALF

    @numba.njit(nogil=True, error_model="numpy")
    def _normal_pairs(f_of, exponent, top, m, mean, std, out, o0):  # pragma: no cover - compiled
        """Version 2's Box-Muller pairs of the first ``m`` (:func:`transpiler.row_init.normal_pairs_v2`),
        ``mean + std * z`` written to ``out[o0 + 2t]`` and ``out[o0 + 2t + 1]``; branch-free, so it
        vectorizes."""
        dst = out[o0 : o0 + 2 * m]  # indices from 0, which LLVM knows are not negative
        for t in range(m):
            f = f_of[t]
            low = f < _SQRT_HALF
            f2 = f * 2.0
            f = f2 if low else f
            e = exponent[t]
            e = e - 1.0 if low else e
            s = (f - 1.0) / (f + 1.0)
            s2 = s * s
            tt = 2.0 * s
            h = (((_L0 * s2 + _L1) * s2 + _L2) * s2 + _L3) * s2 + _L4
            r = np.sqrt(-2.0 * (e * _LN2 + (tt + tt * (s2 * h))))
            bits = top[t]
            octant = np.int64(bits >> np.uint64(50))
            odd = (octant & 1) != 0
            rem = np.int64(bits & _OCTANT_U)
            rem = rem ^ _OCTANT if odd else rem
            a = (np.float64(rem) + 0.5) * _ANGLE
            a = -a if odd else a
            a2 = a * a
            sin_a = a + a * (a2 * ((((_S0 * a2 + _S1) * a2 + _S2) * a2 + _S3) * a2 + _S4))
            cos_a = 1.0 + a2 * (((((_C0 * a2 + _C1) * a2 + _C2) * a2 + _C3) * a2 + _C4) * a2 + _C5)
            # k quarter turns: (cos, sin)(k pi/2 + a) is (c, s), (-s, c), (-c, -s), (s, -c); the definition's
            # rotation multiplies by 0 and +-1, which gives these exactly (sin a, cos a are never 0).
            k = ((octant + 1) >> 1) & 3
            swap = (k & 1) != 0
            x = sin_a if swap else cos_a
            y = cos_a if swap else sin_a
            x = -x if (k == 1 or k == 2) else x
            y = -y if k >= 2 else y
            dst[2 * t] = mean + std * (r * x)
            dst[2 * t + 1] = mean + std * (r * y)

    @numba.njit(nogil=True, error_model="numpy")
    def _normal2_block(keys, k0, k1, seed, mean, std, out, o0):  # pragma: no cover - compiled
        """Rows ``out[o0 : o0 + k1 - k0]`` = version 2's normal rows of ``keys[k0:k1]``, staged in chunks."""
        dim = out.shape[1]
        pairs = (dim + 1) // 2
        size = CHUNK_ROWS * pairs
        q, exponent, top = np.empty(size, np.float64), np.empty(size, np.float64), np.empty(size, np.uint64)
        q_bits = q.view(np.uint64)
        flat = out.reshape(-1)
        odd = np.empty(CHUNK_ROWS * 2 * pairs if dim % 2 else 0, np.float64)  # an odd dim's last pair
        for a in range(k0, k1, CHUNK_ROWS):
            b = min(k1, a + CHUNK_ROWS)
            m = (b - a) * pairs
            _pair_bits(keys, a, b, seed, pairs, q, top)
            _frexp(q_bits, exponent, m)
            row = o0 + a - k0
            if dim % 2 == 0:
                _normal_pairs(q, exponent, top, m, mean, std, flat, row * dim)
                continue
            _normal_pairs(q, exponent, top, m, mean, std, odd, 0)
            for i in range(b - a):
                for j in range(dim):
                    out[row + i, j] = odd[i * 2 * pairs + j]

    @numba.njit(nogil=True, error_model="numpy")
    def init_block(keys, k0, k1, init, initf, out, o0):  # pragma: no cover - compiled
        """Rows ``out[o0 : o0 + k1 - k0]`` = the initial rows of ``keys[k0:k1]`` (kinds ZEROS, UNIFORM,
        NORMAL2; ``out`` C-contiguous)."""
        dim = out.shape[1]
        kind = init[0]
        if kind == NORMAL2:
            _normal2_block(keys, k0, k1, np.uint64(init[1]), initf[0], initf[1], out, o0)
            if not init[2]:  # no padding_idx: nothing per id is left to do
                return
        for i in range(k0, k1):
            r = o0 + i - k0
            key = keys[i]
            if kind == ZEROS or (init[2] and key == init[3]):
                for j in range(dim):
                    out[r, j] = 0
            elif kind == UNIFORM:
                base = _mix(np.uint64(key) * _GOLDEN + np.uint64(init[1]))
                for j in range(dim):
                    u1 = (
                        np.float64(_mix(base ^ (np.uint64(j + 1) * _COLUMN)) >> np.uint64(11)) + 1.0
                    ) * _UNIT
                    out[r, j] = initf[0] + initf[1] * (1.0 - u1)

    from numba import types

    _ids = types.Array(types.int64, 1, "C", readonly=True)  # a view of a received payload
    _init = types.Tuple([types.Array(types.int64, 1, "C"), types.Array(types.float64, 1, "C")])

    @numba.njit(
        [
            types.void(_ids, types.Array(types.int64, 1, "C"), types.int64, _init, types.Array(t, 2, "C"))
            for t in (types.float32, types.float64)
        ],
        cache=True,
        nogil=True,
        error_model="numpy",
    )
    def init_rows(ids, sel, n_sel, init, out):  # pragma: no cover - compiled
        """``out[i]`` = the initial row of ``ids[i]`` for ``i`` in ``sel[:n_sel]`` (every ``i`` when
        ``n_sel < 0``); kinds ZEROS, UNIFORM, NORMAL2."""
        if n_sel < 0:
            init_block(ids, 0, ids.size, init[0], init[1], out, 0)
            return
        keys = np.empty(n_sel, np.int64)
        for t in range(n_sel):
            keys[t] = ids[sel[t]]
        rows = np.empty((n_sel, out.shape[1]), out.dtype)
        init_block(keys, 0, n_sel, init[0], init[1], rows, 0)
        for t in range(n_sel):
            for j in range(out.shape[1]):
                out[sel[t], j] = rows[t, j]
