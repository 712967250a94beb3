"""A pserver's payloads: a data-channel request read into what the engine counts, an answer written out.

The layouts are :mod:`psproto.dataplane.payload`'s, computed here once per lane count from the plan (the
pserver's blocks in plan order, dealt to lanes by :func:`psproto.lane_blocks.lane_of_blocks` as the
gRPC path deals them). Reading checks what the gRPC path checks (sizes, counts, every id on this
shard, finite gradients unless ``nonfinite_grads`` allows them) and refuses with
:class:`~pserver.errors.BadRequest`; it copies nothing but narrowed gradients (widened to the
blocks' dtype) and duplicate table ids (merged): the tensors it hands out are views of the payload.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, List, Mapping, Sequence, Tuple

import numpy as np
import torch

from psproto.dataplane.payload import (
    ALIGN,
    WIRE_DTYPES,
    DenseLayout,
    PayloadError,
    PushLayout,
    TableCounts,
    TableShape,
    aligned,
    rows_parts,
    view,
)
from psproto.dtypes import DTYPES
from psproto.lane_blocks import lane_of_blocks, split_by_lane
from transpiler.tables import merge_duplicates

from ..engine import Contents, PushParts
from ..errors import BadRequest

_ZEROS = np.zeros(ALIGN, dtype=np.uint8)  # padding of inline answers


@dataclass(frozen=True)
class Lane:
    """One lane's blocks: their names in plan order and their layout (in their own dtype)."""

    names: Tuple[str, ...]
    shapes: Tuple[Tuple[int, ...], ...]
    layout: DenseLayout


def _numpy_dtype(name: str):
    return np.uint16 if name == "bfloat16" else np.dtype(name)


class Payloads:
    """Reads requests and writes answers for the pserver whose blocks and tables ``contents`` describes."""

    def __init__(self, contents: Contents, allow_nonfinite: bool):
        self.contents = contents
        self.allow_nonfinite = allow_nonfinite
        specs = contents.store.specs
        self._blocks = [(name, spec) for name, spec in specs.items()]
        tables = contents.tables.specs if contents.tables else {}
        self.table_names = tuple(tables)
        self.table_shapes = tuple(TableShape(t.dim, t.dtype) for t in tables.values())

    @functools.lru_cache(maxsize=64)
    def lane(self, lanes: int, lane: int) -> Lane:
        """Lane ``lane`` of ``lanes``'s blocks (all of them with one lane)."""
        names = [name for name, _ in self._blocks]
        if lanes > 1:
            lane_of = lane_of_blocks([(name, spec.nbytes) for name, spec in self._blocks], lanes)
            names = [names[i] for i in split_by_lane(names, lane_of, lanes)[lane]]
        specs = dict(self._blocks)
        layout = DenseLayout.of([(n, specs[n].numel, specs[n].dtype) for n in names])
        return Lane(tuple(names), tuple(tuple(specs[n].shape) for n in names), layout)

    @functools.lru_cache(maxsize=64)
    def _wire(self, lanes: int, lane: int, wire_dtype: str) -> DenseLayout:
        blocks = self.lane(lanes, lane)
        return DenseLayout.of(list(zip(blocks.names, blocks.layout.numels, blocks.layout.dtypes)), wire_dtype)

    # -- reading requests ---------------------------------------------------------------------------

    def push(self, payload: np.ndarray, lanes: int, lane: int, grad_dtype: int, dropped: bool) -> PushParts:
        """A push payload's parts: dense gradients by block, sparse gradients and next ids by table."""
        wire = WIRE_DTYPES.get(grad_dtype, "") if grad_dtype else ""
        if grad_dtype and not wire:
            raise BadRequest(f"unknown gradient wire dtype {grad_dtype}")
        blocks = self.lane(lanes, lane)
        dense_layout = self._wire(lanes, lane, wire) if wire else blocks.layout
        with_tables = lane == 0 and bool(self.table_names)
        dense_at = 0 if dropped or not len(blocks.names) else aligned(len(blocks.names)) + dense_layout.nbytes
        counts = self._counts(payload, dense_at) if with_tables else TableCounts((), ())
        try:
            layout = PushLayout.of(
                dense_layout, not dropped, self.table_shapes if with_tables else (), counts
            )
        except KeyError as e:
            raise BadRequest(f"bad payload: {e}") from None
        if payload.size != layout.nbytes:
            raise BadRequest(
                f"a push payload of {payload.size} bytes; its counts and this pserver's plan give "
                f"{layout.nbytes}"
            )
        dense = {} if dropped else self._dense(payload, layout, blocks, dense_layout, wire)
        sparse, answer_ids = {}, {}
        for name, shape, (ids, rows, nxt) in zip(self.table_names, self.table_shapes, layout.tables):
            grad_ids = view(payload, ids, np.int64)
            if grad_ids.size:
                if dropped:
                    raise BadRequest("a dropped push carries no gradients (backup_trainers)")
                grad_rows = view(payload, rows, np.dtype(shape.dtype)).reshape(-1, shape.dim)
                self._finite(grad_rows, name)
                self.contents.tables.shards[name].check_ids(grad_ids)
                sparse[name] = merge_duplicates(grad_ids, torch.from_numpy(grad_rows))
            next_ids = view(payload, nxt, np.int64)
            if next_ids.size:
                self.contents.tables.shards[name].check_ids(next_ids)
                answer_ids[name] = next_ids
        return PushParts(dense, sparse, answer_ids)

    def prefetch(self, payload: np.ndarray) -> Dict[str, np.ndarray]:
        """A prefetch payload's ids by table (every id checked to be on this shard)."""
        if not self.table_names:
            raise BadRequest("a prefetch to a pserver without distributed tables")
        counts = self._counts(payload, 0)
        if any(counts.grads):
            raise BadRequest("a prefetch carries next ids only, not gradients")
        layout = PushLayout.of(DenseLayout.of([]), False, self.table_shapes, counts)
        if payload.size != layout.nbytes:
            raise BadRequest(f"a prefetch payload of {payload.size} bytes; its counts give {layout.nbytes}")
        out = {}
        for name, (_, _, nxt) in zip(self.table_names, layout.tables):
            ids = view(payload, nxt, np.int64)
            if ids.size:
                self.contents.tables.shards[name].check_ids(ids)
                out[name] = ids
        return out

    def _counts(self, payload: np.ndarray, at: int) -> TableCounts:
        try:
            counts = TableCounts.unpack(payload[at:], len(self.table_names))
        except PayloadError as e:
            raise BadRequest(str(e)) from None
        limit = payload.size // 8
        if any(n > limit for n in counts.grads + counts.nexts):
            raise BadRequest(
                f"table counts {counts.grads + counts.nexts} beyond a payload of {payload.size} bytes"
            )
        return counts

    def _dense(
        self, payload: np.ndarray, layout: PushLayout, blocks: Lane, dense: DenseLayout, wire: str
    ) -> Dict[str, torch.Tensor]:
        presence = view(payload, layout.presence, np.uint8)
        if presence.size and presence.max() > 1:
            raise BadRequest("block presence bytes must be 0 or 1")
        section = payload[layout.dense[0] : layout.dense[0] + layout.dense[1]]
        out = {}
        for i in np.flatnonzero(presence):
            name, shape = blocks.names[i], blocks.shapes[i]
            start = dense.offsets[i]
            raw = section[start : start + dense.numels[i] * np.dtype(_numpy_dtype(dense.dtypes[i])).itemsize]
            grad = torch.from_numpy(raw.view(_numpy_dtype(dense.dtypes[i])))
            if wire == "bfloat16":
                grad = grad.view(torch.bfloat16)
            block_dtype = DTYPES[blocks.layout.dtypes[i]]
            if grad.dtype != block_dtype:
                grad = grad.to(block_dtype)
            grad = grad.view(shape)
            if not self.allow_nonfinite and not bool(torch.isfinite(grad).all()):
                raise BadRequest(
                    f"gradient of {name} holds NaN or Inf; push refused (nonfinite_grads='refuse')"
                )
            out[name] = grad
        return out

    def _finite(self, rows: np.ndarray, table: str) -> None:
        if not self.allow_nonfinite and not np.isfinite(rows).all():
            raise BadRequest(
                f"gradient of table {table!r} holds NaN or Inf; push refused (nonfinite_grads='refuse')"
            )

    # -- writing answers ----------------------------------------------------------------------------

    def answer_bytes(self, lane: Lane, answer_ids: Mapping[str, np.ndarray]) -> int:
        """Bytes of an answer with ``lane``'s blocks and the rows of ``answer_ids``."""
        nexts = [len(answer_ids.get(n, ())) for n in self.table_names]
        return (
            rows_parts(self.table_shapes, nexts, lane.layout.nbytes)[1]
            if self.table_names
            else lane.layout.nbytes
        )

    def write(
        self, out: np.ndarray, lane: Lane, blocks: Sequence[Tuple[str, torch.Tensor]], rows: Sequence
    ) -> int:
        """Write ``blocks`` (the lane's, in order) and ``rows`` (``(wire name, rows)`` per table asked, in
        plan order) into ``out`` (uint8, the answer region); the bytes written."""
        for (name, block), offset in zip(blocks, lane.layout.offsets, strict=True):
            data = block.detach().reshape(-1).numpy()
            out[offset : offset + data.nbytes].view(data.dtype)[:] = data
        at = lane.layout.nbytes
        for _, r in rows:
            data = np.asarray(r).reshape(-1)
            out[at : at + data.nbytes].view(data.dtype)[:] = data
            at = aligned(at + data.nbytes)
        return at

    def buffers(self, lane: Lane, blocks: Sequence[Tuple[str, torch.Tensor]], rows: Sequence) -> List:
        """The same answer as :meth:`write`, as buffers to send in order (with the padding between parts)."""
        out: List = []
        at = 0
        for (_, block), offset in zip(blocks, lane.layout.offsets, strict=True):
            if offset > at:
                out.append(_ZEROS[: offset - at])
            data = block.detach().reshape(-1).numpy()
            out.append(data)
            at = offset + data.nbytes
        if lane.layout.nbytes > at:
            out.append(_ZEROS[: lane.layout.nbytes - at])
        at = lane.layout.nbytes
        for _, r in rows:
            data = np.asarray(r).reshape(-1)
            out.append(data)
            end = aligned(at + data.nbytes)
            if end > at + data.nbytes:
                out.append(_ZEROS[: end - at - data.nbytes])
            at = end
        return out

    def check_pull(self, lanes: int, lane: int) -> Lane:
        """The lane a pull asks for; :class:`BadRequest` for a lane beyond ``lanes``."""
        if not 0 <= lane < lanes:
            raise BadRequest(f"lane {lane} of {lanes}")
        return self.lane(lanes, lane)
