"""Initial rows of distributed tables: the value of a row never updated, a pure function of (seed, id).

Element ``(id, j)`` is drawn from a counter-based generator keyed by (table seed, id, column):
``base = mix(id * GOLDEN + seed)`` per id, then per column ``c`` the uniform bits
``mix(base ^ cols[c])`` and ``mix((base + GOLDEN) ^ cols[c])`` (``mix``: splitmix64's finaliser,
``cols[c] = (c + 1) * COLUMN``). ``uniform`` and ``zeros`` are the same in every version; ``normal``
is versioned (``TableSpec.init_version``), so that tables, checkpoints and exports written with one
definition read the same rows for ever:

- **version 1** (plans and files without the field): per element, Box-Muller with float64
  ``log``, ``sqrt`` and ``cos`` (numpy's), on the uniforms of column j.
- **version 2** (new plans): per *pair* of elements ``(2p, 2p + 1)``, Box-Muller's two outputs
  ``r * cos(theta)`` and ``r * sin(theta)`` from the uniforms of column p, with ``log``, ``cos`` and
  ``sin`` replaced by fixed polynomials in float64 (no libm call: a compiled pserver computes them
  in a few arithmetic instructions, and every platform gets the same bits):

  * ``u1 = q / 2**53`` with ``q = (bits1 >> 11) + 1``; ``q = f * 2**e`` with f in [sqrt(1/2), sqrt(2))
    (frexp, then f doubled when below sqrt(1/2)); ``ln u1 = (e - 53) * ln 2 + ln f``, ``ln f`` the
    atanh series ``2s (1 + s^2/3 + ... + s^10/11)``, ``s = (f - 1) / (f + 1)``, ``|s| < 0.172``;
  * ``theta = 2 pi u2`` from the 53 bits of ``bits2 >> 11``: the top 3 pick the octant, the other 50
    the point ``(rem + 0.5) / 2**50`` within it, so the reduction to ``|a| <= pi/4`` is exact
    (``theta = k pi/2 + a``); ``sin a`` and ``cos a`` by Taylor polynomials to ``a^11`` and
    ``a^12``, rotated by ``k`` quarter turns.

  Against float64 libm on the same uniforms, a draw differs by less than 3e-11 relative to its
  radius (1M draws, tests/tables/test_initial_rows.py), far below float32's 6e-8.

:func:`initial_rows` is the definition in numpy; :mod:`pserver.tables.compiled.row_kernels` compiles the same
operations in the same order (bit for bit, tested).
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Protocol

import numpy as np


class RowSpec(Protocol):
    """What the definition reads of a table's spec (:class:`transpiler.tables.TableSpec` has it all; that
    module imports this one, so this one names only the fields)."""

    name: str
    dim: int
    dtype: str
    seed: int
    init: str
    init_kwargs: Dict[str, float]
    padding_idx: Optional[int]
    init_version: int


INIT_VERSIONS = (1, 2)  # what TableSpec.init_version may be; 2 for new plans, 1 where a file has none

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
COLUMN = np.uint64(0xD1B54A32D192ED03)

# Version 2's constants (float64): ln f's atanh series (Horner, highest first), sin a and cos a on
# |a| <= pi/4 (Taylor, highest first), the angle of one step of an octant's 2**50 points, and the
# rotation by k quarter turns: cos(k pi/2 + a) = COS_C[k] cos a + COS_S[k] sin a, sin likewise.
SQRT_HALF = 0.7071067811865476
LN2 = 0.6931471805599453
LOG_SERIES = (1 / 11, 1 / 9, 1 / 7, 1 / 5, 1 / 3)
SIN_SERIES = (-1 / 39916800, 1 / 362880, -1 / 5040, 1 / 120, -1 / 6)
COS_SERIES = (1 / 479001600, -1 / 3628800, 1 / 40320, -1 / 720, 1 / 24, -1 / 2)
ANGLE_STEP = (math.pi / 4) / 2**50
OCTANT_BITS = np.uint64((1 << 50) - 1)
COS_C = np.array([1.0, 0.0, -1.0, 0.0])
COS_S = np.array([0.0, -1.0, 0.0, 1.0])
SIN_C = np.array([0.0, 1.0, 0.0, -1.0])
SIN_S = np.array([1.0, 0.0, -1.0, 0.0])


def mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays, in place."""
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def unit(bits: np.ndarray) -> np.ndarray:
    """Uniform floats in (0, 1] from the top 53 bits of uint64 values."""
    return ((bits >> np.uint64(11)).astype(np.float64) + 1.0) * (1.0 / (1 << 53))


def horner(coefficients, x):
    """``((c0 * x + c1) * x + ...) + c_last``, highest coefficient first."""
    h = coefficients[0]
    for c in coefficients[1:]:
        h = h * x + c
    return h


def normal_pairs_v2(bits1: np.ndarray, bits2: np.ndarray):
    """Version 2's Box-Muller pair ``(r cos theta, r sin theta)`` of uniform bits, elementwise (float64)."""
    f, e = np.frexp(((bits1 >> np.uint64(11)) + np.uint64(1)).astype(np.float64))
    low = f < SQRT_HALF
    f = np.where(low, f * 2.0, f)
    e = (e - low - 53).astype(np.float64)
    s = (f - 1.0) / (f + 1.0)
    s2 = s * s
    t = 2.0 * s
    r = np.sqrt(-2.0 * (e * LN2 + (t + t * (s2 * horner(LOG_SERIES, s2)))))
    top = bits2 >> np.uint64(11)
    octant = top >> np.uint64(50)
    odd = (octant & np.uint64(1)).astype(bool)
    rem = np.where(odd, (top & OCTANT_BITS) ^ OCTANT_BITS, top & OCTANT_BITS)
    a = (rem.astype(np.float64) + 0.5) * ANGLE_STEP
    a = np.where(odd, -a, a)
    a2 = a * a
    sin_a = a + a * (a2 * horner(SIN_SERIES, a2))
    cos_a = 1.0 + a2 * horner(COS_SERIES, a2)
    k = (((octant + np.uint64(1)) >> np.uint64(1)) & np.uint64(3)).astype(np.intp)
    return r * (COS_C[k] * cos_a + COS_S[k] * sin_a), r * (SIN_C[k] * cos_a + SIN_S[k] * sin_a)


def initial_rows(spec: RowSpec, ids: np.ndarray) -> np.ndarray:
    """Initial values of the rows ``ids`` of table ``spec``: (len(ids), dim), the table's dtype.

    The definition of ``spec.init_version`` (see the module docstring), vectorised over all ids;
    the ``padding_idx`` row is zero, as in ``nn.Embedding``.
    """
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    dtype = np.dtype(spec.dtype)
    if spec.init_version not in INIT_VERSIONS:
        raise ValueError(
            f"table {spec.name!r}: init_version {spec.init_version!r} is not one of {INIT_VERSIONS}"
        )
    if spec.init == "zeros" or ids.size == 0:
        return np.zeros((ids.size, spec.dim), dtype=dtype)
    kw = spec.init_kwargs
    with np.errstate(over="ignore"):
        base = mix(ids.view(np.uint64) * GOLDEN + np.uint64(spec.seed))
        other = base + GOLDEN
        if spec.init == "uniform":
            cols = np.arange(1, spec.dim + 1, dtype=np.uint64) * COLUMN
            u1 = unit(mix(base[:, None] ^ cols[None, :]))
            out = kw["a"] + (kw["b"] - kw["a"]) * (1.0 - u1)  # [a, b)
        elif spec.init_version == 1:
            cols = np.arange(1, spec.dim + 1, dtype=np.uint64) * COLUMN
            u1 = unit(mix(base[:, None] ^ cols[None, :]))
            u2 = unit(mix(other[:, None] ^ cols[None, :]))
            normal = np.sqrt(-2.0 * np.log(u1)) * np.cos((2.0 * math.pi) * u2)
            out = kw["mean"] + kw["std"] * normal
        else:
            pairs = (spec.dim + 1) // 2
            cols = np.arange(1, pairs + 1, dtype=np.uint64) * COLUMN
            z_cos, z_sin = normal_pairs_v2(
                mix(base[:, None] ^ cols[None, :]), mix(other[:, None] ^ cols[None, :])
            )
            normal = np.stack([z_cos, z_sin], axis=2).reshape(ids.size, 2 * pairs)[:, : spec.dim]
            out = kw["mean"] + kw["std"] * normal
    out = out.astype(dtype, copy=False)
    if spec.padding_idx is not None:
        out[ids == spec.padding_idx] = 0
    return out
