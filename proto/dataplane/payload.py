"""The data channel's payloads: where each block and each table's ids and rows sit (version 1).

Both sides compute every offset from the plan, so a payload carries no names: a pserver's blocks in a
lane (:func:`psproto.lane_blocks.lane_of_blocks`; all of them with one lane) sit at fixed offsets,
in plan order, and the tables come in plan order. Every part starts at a multiple of :data:`ALIGN`
bytes, so a part is a view of the payload with no copy, and a pserver's flat block buffer uses the
same offsets (:class:`DenseLayout`): a whole push's dense section *is* the flat gradient.

A push (PUSH_PULL) payload::

    presence   uint8 per block of the lane: 1 if the trainer has a gradient for it (padded)
    dense      the lane's blocks' gradients at DenseLayout's offsets, in the wire dtype (absent: any)
    counts     lane 0 only: per table (uint64 gradient ids, uint64 next ids, uint64 flags: 1 graded)
    per table  gradient ids (int64), gradient rows (n x dim, the table's dtype), next ids (int64)

A dropped push (backup trainers) and a pull carry no dense part; a pull carries nothing else either.
A prefetch carries counts (gradient ids 0) and next ids. The answer to a push or pull: the lane's
blocks in their own dtype at DenseLayout's offsets, then, per table asked, the rows of its next
ids (n x dim) in request order; to a prefetch, those rows alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import numpy as np

ALIGN = 64

# Wire dtypes of dense gradients: code -> numpy dtype name (0 means the blocks' own dtype).
# bfloat16 travels as its uint16 bits (numpy has no bfloat16).
WIRE_DTYPES = {1: "float32", 2: "float64", 3: "float16", 4: "bfloat16"}
WIRE_CODES = {name: code for code, name in WIRE_DTYPES.items()}
ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4}

_COUNT = np.dtype("<u8")


class PayloadError(ValueError):
    """A payload whose size or counts do not match the layout the plan gives."""


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-nbytes // ALIGN) * ALIGN


@dataclass(frozen=True)
class DenseLayout:
    """Blocks (name, element count, dtype) laid out one after another, each at an :data:`ALIGN`-byte offset.

    ``offsets[i]`` is block i's byte offset, ``nbytes`` the whole; with ``wire_dtype`` every block
    travels in that dtype (a narrowed gradient) instead of its own.
    """

    names: Tuple[str, ...]
    numels: Tuple[int, ...]
    dtypes: Tuple[str, ...]
    offsets: Tuple[int, ...]
    nbytes: int

    @classmethod
    def of(cls, blocks: Sequence[Tuple[str, int, str]], wire_dtype: str = "") -> "DenseLayout":
        """The layout of ``blocks`` in order; every block in ``wire_dtype`` when given."""
        offsets, at = [], 0
        for _, numel, dtype in blocks:
            offsets.append(at)
            at = aligned(at + numel * ITEMSIZE[wire_dtype or dtype])
        return cls(
            tuple(b[0] for b in blocks),
            tuple(b[1] for b in blocks),
            tuple(wire_dtype or b[2] for b in blocks),
            tuple(offsets),
            at,
        )

    def __len__(self) -> int:
        return len(self.names)

    def uniform_dtype(self) -> str:
        """The one dtype of every block ("" when they differ or there are none)."""
        return self.dtypes[0] if self.dtypes and len(set(self.dtypes)) == 1 else ""


@dataclass(frozen=True)
class TableCounts:
    """Per table in plan order: how many gradient ids and how many next ids a payload carries, and whether it
    carries the table's gradient at all (``graded``: a trainer whose batch had no id on this shard still
    pushes the table's gradient, with no ids: torch's optimizers count a step for it)."""

    grads: Tuple[int, ...]
    nexts: Tuple[int, ...]
    graded: Tuple[bool, ...] = ()

    WORDS = 3  # uint64 per table: gradient ids, next ids, flags (bit 0: graded)

    def nbytes(self) -> int:
        return aligned(len(self.grads) * self.WORDS * _COUNT.itemsize)

    def pack(self) -> np.ndarray:
        """The counts part: uint64 triples, padded."""
        out = np.zeros(self.nbytes() // _COUNT.itemsize, dtype=_COUNT)
        n = len(self.grads)
        out[0 : self.WORDS * n : self.WORDS] = self.grads
        out[1 : self.WORDS * n : self.WORDS] = self.nexts
        out[2 : self.WORDS * n : self.WORDS] = self.graded or (False,) * n
        return out

    @classmethod
    def unpack(cls, data: np.ndarray, tables: int) -> "TableCounts":
        """The counts of ``tables`` tables at the start of ``data`` (uint8)."""
        need = aligned(tables * cls.WORDS * _COUNT.itemsize)
        if data.size < need:
            raise PayloadError(f"the table counts need {need} bytes, the payload holds {data.size}")
        words = data[: tables * cls.WORDS * _COUNT.itemsize].view(_COUNT)
        flags = words[2 :: cls.WORDS]
        if (flags > 1).any():
            raise PayloadError(f"unknown table flags {sorted(set(int(f) for f in flags))}")
        return cls(
            tuple(int(n) for n in words[0 :: cls.WORDS]),
            tuple(int(n) for n in words[1 :: cls.WORDS]),
            tuple(bool(f) for f in flags),
        )


@dataclass(frozen=True)
class TableShape:
    """What a payload needs of a table: its row width and its rows' dtype."""

    dim: int
    dtype: str


def table_parts(tables: Sequence[TableShape], counts: TableCounts, start: int) -> Tuple[List[tuple], int]:
    """Byte ranges ``(ids, rows, next ids)`` per table from ``start``, each ``(offset, nbytes)``; and the
    end."""
    parts, at = [], start
    for shape, n, m in zip(tables, counts.grads, counts.nexts, strict=True):
        ids = (at, n * 8)
        at = aligned(at + n * 8)
        rows = (at, n * shape.dim * ITEMSIZE[shape.dtype])
        at = aligned(at + rows[1])
        nxt = (at, m * 8)
        at = aligned(at + m * 8)
        parts.append((ids, rows, nxt))
    return parts, at


def rows_parts(tables: Sequence[TableShape], nexts: Sequence[int], start: int) -> Tuple[List[tuple], int]:
    """Byte ranges of the answer's rows per table (``nexts[i]`` rows of table i) from ``start``; and the
    end."""
    parts, at = [], start
    for shape, m in zip(tables, nexts, strict=True):
        parts.append((at, m * shape.dim * ITEMSIZE[shape.dtype]))
        at = aligned(at + m * shape.dim * ITEMSIZE[shape.dtype])
    return parts, at


@dataclass(frozen=True)
class PushLayout:
    """Every offset of one push payload: presence, dense, counts and table parts (see the module doc)."""

    presence: Tuple[int, int]  # (offset, nbytes); (0, 0) without a dense part
    dense: Tuple[int, int]
    counts: Tuple[int, int]  # (0, 0) without tables
    tables: Tuple[tuple, ...]  # per table ((ids), (rows), (next ids)), each (offset, nbytes)
    nbytes: int

    @classmethod
    def of(cls, dense: DenseLayout, with_dense: bool, tables: Sequence[TableShape], counts: TableCounts):
        """The layout of a push with ``dense`` (when ``with_dense``) and ``tables`` carrying ``counts``."""
        at = 0
        presence = dense_part = (0, 0)
        if with_dense and len(dense):
            presence = (0, len(dense))
            at = aligned(len(dense))
            dense_part = (at, dense.nbytes)
            at += dense.nbytes
        counts_part = (0, 0)
        parts: List[tuple] = []
        if tables:
            counts_part = (at, counts.nbytes())
            parts, at = table_parts(tables, counts, at + counts.nbytes())
        return cls(presence, dense_part, counts_part, tuple(parts), at)


def view(payload: np.ndarray, part: Tuple[int, int], dtype) -> np.ndarray:
    """``part`` of ``payload`` (uint8) as a 1-D array of ``dtype``, no copy."""
    offset, nbytes = part
    return payload[offset : offset + nbytes].view(dtype)


def counts_of(tables: Dict[str, np.ndarray], names: Sequence[str]) -> Tuple[int, ...]:
    """Per table of ``names``, the length of its array in ``tables`` (0 if absent)."""
    return tuple(int(tables[n].shape[0]) if n in tables else 0 for n in names)
