"""A trainer's data-channel payloads for one pserver: a push's tensors written out, an answer read back.

The layout is :mod:`psproto.dataplane.payload`'s, from the plan: the pserver's blocks in plan order
(dealt to lanes as the pserver deals them), its tables in plan order. A push's tensors come as the
gRPC path takes them (``(wire name, tensor)``: block gradients, ``<table>@ids`` / ``@rows`` /
``@next``); writing them puts each where the layout says, in the payload buffer or straight into the
request region. An answer's blocks and rows are copied into the destinations ``decode_into`` names,
as the gRPC path's decoder does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, Iterable, Optional, Sequence, Tuple

import numpy as np
import torch

from psproto.dataplane.payload import (
    WIRE_CODES,
    DenseLayout,
    PushLayout,
    TableCounts,
    TableShape,
    aligned,
    rows_parts,
    view,
)
from psproto.dtypes import dtype_name
from psproto.lane_blocks import lane_of_blocks, split_by_lane
from transpiler.plans import BlockSpec
from transpiler.tables import SPARSE_SEPARATOR, TableSpec

from ..wire_paths import DecodeInto, Named

_PARTS = ("ids", "rows", "next")


@dataclass(frozen=True)
class Lane:
    """One lane of a pserver's blocks: names in plan order, their index here, their layout."""

    names: Tuple[str, ...]
    index: Dict[str, int]
    layout: DenseLayout


@dataclass(frozen=True)
class Push:
    """A push laid out: its layout, the next ids asked per table (in plan order), its wire dtype code, and
    its tensors sorted (block gradients by name, ``{(table index, part): tensor}``) for :meth:`write_push`."""

    layout: PushLayout
    nexts: Tuple[int, ...]
    grad_dtype: int
    dense: Dict[str, torch.Tensor]
    tables: Dict[Tuple[int, str], torch.Tensor]


def _np(t: torch.Tensor) -> np.ndarray:
    """``t``'s bytes as numpy (bfloat16 as its uint16 bits), flat."""
    t = t.detach().reshape(-1)
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy()


class PserverPayloads:
    """The payloads of calls to one pserver whose ``blocks`` (plan order) and ``tables`` the plan gives."""

    def __init__(self, blocks: Sequence[BlockSpec], tables: Sequence[TableSpec]):
        self._blocks = list(blocks)
        self._tables = list(tables)
        self._table_index = {t.name: i for i, t in enumerate(tables)}
        self._shapes = tuple(TableShape(t.dim, t.dtype) for t in tables)
        # The plan's own dtypes: gradients all in one other dtype are narrowed (grad_wire_dtype).
        self._own_dtypes = {getattr(torch, b.dtype) for b in self._blocks} | {
            getattr(torch, t.dtype) for t in self._tables
        }

    @functools.lru_cache(maxsize=64)
    def lane(self, lanes: int, lane: int) -> Lane:
        """Lane ``lane`` of ``lanes``: its blocks, in their own dtype."""
        names = [b.name for b in self._blocks]
        if lanes > 1:
            lane_of = lane_of_blocks([(b.name, b.nbytes) for b in self._blocks], lanes)
            names = [names[i] for i in split_by_lane(names, lane_of, lanes)[lane]]
        specs = {b.name: b for b in self._blocks}
        layout = DenseLayout.of([(n, specs[n].numel, specs[n].dtype) for n in names])
        return Lane(tuple(names), {n: i for i, n in enumerate(names)}, layout)

    @functools.lru_cache(maxsize=64)
    def _wire(self, lanes: int, lane: int, wire: str) -> DenseLayout:
        blocks = self.lane(lanes, lane)
        return DenseLayout.of(list(zip(blocks.names, blocks.layout.numels, blocks.layout.dtypes)), wire)

    def is_table_tensor(self, name: str) -> bool:
        """Whether ``name`` is a table's wire tensor (``<table>@ids`` / ``@rows`` / ``@next``) of this
        plan."""
        table, sep, part = name.rpartition(SPARSE_SEPARATOR)
        return bool(sep) and part in _PARTS and table in self._table_index

    def new_rows(self, nexts: Sequence[int]) -> Dict[str, torch.Tensor]:
        """A new ``(n, dim)`` tensor per table with ``n`` rows asked, by its ``<table>@rows`` name."""
        return {
            t.rows_name: torch.empty((n, t.dim), dtype=getattr(torch, t.dtype))
            for t, n in zip(self._tables, nexts)
            if n
        }

    def _sort(self, tensors: Iterable[Named]):
        """(block gradients by name, {(table index, part): tensor})."""
        dense, tables = {}, {}
        for name, t in tensors:
            table, sep, part = name.rpartition(SPARSE_SEPARATOR)
            if sep and part in _PARTS and table in self._table_index:
                tables[(self._table_index[table], part)] = t
            else:
                dense[name] = t
        return dense, tables

    def plan_push(self, tensors: Sequence[Named], lanes: int, lane: int, dropped: bool) -> Push:
        """The layout of a push of ``tensors`` on lane ``lane`` of ``lanes``."""
        dense, tables = self._sort(tensors)
        # A narrowed push (grad_wire_dtype) has every gradient in the wire dtype, table rows included.
        dtypes = {t.dtype for t in dense.values()} | {
            t.dtype for (_, part), t in tables.items() if part == "rows"
        }
        wire = dtype_name(dtypes.pop()) if len(dtypes) == 1 and not dtypes <= self._own_dtypes else ""
        layout = self._wire(lanes, lane, wire) if wire else self.lane(lanes, lane).layout
        if not (lane == 0 and self._tables):
            return Push(
                PushLayout.of(layout, not dropped, (), TableCounts((), ())), (), _code(wire), dense, tables
            )
        n = len(self._tables)
        nexts = tuple(len(tables[(i, "next")]) if (i, "next") in tables else 0 for i in range(n))
        graded = tuple((i, "ids") in tables for i in range(n))
        counts = TableCounts(
            tuple(len(tables[(i, "ids")]) if g else 0 for i, g in enumerate(graded)), nexts, graded
        )
        shapes = tuple(TableShape(t.dim, wire) for t in self._shapes) if wire else self._shapes
        return Push(PushLayout.of(layout, not dropped, shapes, counts), nexts, _code(wire), dense, tables)

    def write_push(self, out: np.ndarray, push: Push, lanes: int, lane: int) -> int:
        """Write the tensors :meth:`plan_push` laid out as ``push`` into ``out`` (uint8, at least
        ``push.layout.nbytes``); the bytes written."""
        dense, tables = push.dense, push.tables
        layout = push.layout
        if layout.presence[1]:
            blocks = self.lane(lanes, lane)
            presence = view(out, layout.presence, np.uint8)
            presence[:] = 0
            wire = self._wire(lanes, lane, _wire_name(push.grad_dtype)) if push.grad_dtype else blocks.layout
            base = layout.dense[0]
            for name, grad in dense.items():
                i = blocks.index[name]
                data = _np(grad)
                start = base + wire.offsets[i]
                out[start : start + data.nbytes].view(data.dtype)[:] = data
                presence[i] = 1
        if layout.counts[1]:
            counts = view(out, layout.counts, np.uint64)
            counts[:] = 0
            w = TableCounts.WORDS
            for i, (ids, rows, nxt) in enumerate(layout.tables):
                g, n = tables.get((i, "ids")), tables.get((i, "next"))
                counts[w * i] = 0 if g is None else len(g)
                counts[w * i + 1] = 0 if n is None else len(n)
                counts[w * i + 2] = int(g is not None)
                for part, (offset, nbytes) in zip(("ids", "rows", "next"), (ids, rows, nxt)):
                    t = tables.get((i, part))
                    if t is not None and nbytes:
                        out[offset : offset + nbytes].view(np.uint8)[:] = _np(t).view(np.uint8)
        return layout.nbytes

    def plan_prefetch(self, ids: Sequence[Named]) -> Push:
        """The layout of a prefetch of ``ids`` (``<table>@ids`` tensors): each table's ids asked as its next
        ids."""
        by_table = {self._table_index[n.rpartition(SPARSE_SEPARATOR)[0]]: t for n, t in ids}
        nexts = tuple(len(by_table[i]) if i in by_table else 0 for i in range(len(self._tables)))
        counts = TableCounts((0,) * len(self._tables), nexts)
        layout = PushLayout.of(DenseLayout.of([]), False, self._shapes, counts)
        return Push(layout, nexts, 0, {}, {(i, "next"): t for i, t in by_table.items()})

    def write_prefetch(self, out: np.ndarray, push: Push) -> int:
        """Write the ids :meth:`plan_prefetch` laid out as ``push`` into ``out``; the bytes written."""
        return self.write_push(out, push, 1, 0)

    def answer_bytes(self, lane: Optional[Lane], nexts: Sequence[int]) -> int:
        """Bytes of an answer with ``lane``'s blocks (None: none) and ``nexts`` rows per table."""
        start = lane.layout.nbytes if lane is not None else 0
        return rows_parts(self._shapes, nexts, start)[1] if nexts else start

    def read_answer(
        self, payload: np.ndarray, lane: Optional[Lane], nexts: Sequence[int], decode_into: DecodeInto
    ) -> int:
        """Copy an answer's blocks (``lane``'s) and rows (``nexts`` per table) into ``decode_into(name)``; the
        tensor bytes copied."""
        expected = self.answer_bytes(lane, nexts)
        if payload.size != expected:
            raise ValueError(f"an answer of {payload.size} bytes where the plan gives {expected}")
        at = copied = 0
        if lane is not None:
            for name, offset, numel, dtype in zip(
                lane.names, lane.layout.offsets, lane.layout.numels, lane.layout.dtypes
            ):
                dest = decode_into(name)
                src = payload[offset : offset + numel * dest.element_size()]
                _copy_into(dest, src, dtype)
                copied += src.nbytes
            at = lane.layout.nbytes
        for table, n in zip(self._tables, nexts):
            if not n:
                continue
            dest = decode_into(table.rows_name)
            nbytes = n * table.row_bytes
            _copy_into(dest, payload[at : at + nbytes], table.dtype)
            copied += nbytes
            at = aligned(at + nbytes)
        return copied


def _code(wire: str) -> int:
    """The header's code of wire dtype ``wire`` (0: the blocks' own)."""
    return WIRE_CODES[wire] if wire else 0


def _wire_name(code: int) -> str:
    from psproto.dataplane.payload import WIRE_DTYPES

    return WIRE_DTYPES[code]


def _copy_into(dest: torch.Tensor, src: np.ndarray, dtype: str) -> None:
    """``dest``'s elements from ``src``'s bytes (``dtype``), as the gRPC decoder copies a piece."""
    if dest.dtype == torch.bfloat16:
        data = torch.from_numpy(src.view(np.int16)).view(torch.bfloat16)
    else:
        data = torch.from_numpy(src.view(np.dtype(dtype)))
    dest.view(-1).copy_(data)
