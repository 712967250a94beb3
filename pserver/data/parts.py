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
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from psproto.dataplane.payload import (
    ALIGN,
    ITEMSIZE,
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

from ..engine import Contents, PushParts
from ..errors import BadRequest
from ..flat import FlatGrad, FlatLayout
from ..flat_optim import flat_is_exact

_ZEROS = np.zeros(ALIGN, dtype=np.uint8)  # padding of inline answers


@dataclass(frozen=True)
class Lane:
    """One lane's blocks: their names in plan order and their layout (in their own dtype)."""

    names: Tuple[str, ...]
    shapes: Tuple[Tuple[int, ...], ...]
    layout: DenseLayout


@dataclass(frozen=True)
class _FlatDense:
    """The store's flat layout when a one-lane push's dense section is a gradient of it: the section's
    dtype, the elements of padding between blocks (zeroed on arrival: the trainer's bytes there are not
    trusted, and the flat optimizer needs zeros) and each block's bytes."""

    layout: FlatLayout
    dtype: np.dtype
    padding: np.ndarray
    nbytes: np.ndarray


def _flat(t) -> np.ndarray:
    """A block or rows (torch or numpy) as flat numpy; bfloat16 as its uint16 bits."""
    if isinstance(t, torch.Tensor):
        t = t.detach().reshape(-1)
        return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
    return np.asarray(t).reshape(-1)


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
        self._flat = self._flat_dense(contents.store.flat_layout)
        # Rows numpy can hold are looked up straight into an answer region (no bfloat16 in numpy).
        self._rows_in_place = all(t.dtype in ("float32", "float64", "float16") for t in self.table_shapes)
        # Bytes of every block (padding aside): an in-place answer's tensor bytes before its rows.
        self.dense_bytes = int(self._flat.nbytes.sum()) if self._flat is not None else 0

    def _flat_dense(self, flat: Optional[FlatLayout]) -> Optional[_FlatDense]:
        """How a one-lane push's dense section is the store's flat gradient as it comes (None: it is not,
        for blocks of several dtypes or of a 16-bit one: those are read block by block)."""
        if flat is None or not len(flat) or not flat_is_exact(flat.dtype):
            return None
        if flat.dense != self.lane(1, 0).layout:
            return None
        padding = np.ones(flat.numel, dtype=bool)
        for start, numel in zip(flat.starts, flat.dense.numels):
            padding[start : start + numel] = False
        itemsize = flat.dtype.itemsize
        numels = np.asarray(flat.dense.numels, dtype=np.int64)
        return _FlatDense(flat, np.dtype(flat.dense.dtypes[0]), np.flatnonzero(padding), numels * itemsize)

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

    def push(
        self, payload: np.ndarray, lanes: int, lane: int, grad_dtype: int, dropped: bool
    ) -> Tuple[PushParts, int]:
        """A push payload's parts (dense gradients by block, sparse gradients and next ids by table) and the
        tensor bytes it carried (as sent: narrowed gradients at their wire size)."""
        wire = WIRE_DTYPES.get(grad_dtype, "") if grad_dtype else ""
        if grad_dtype and not wire:
            raise BadRequest(f"unknown gradient wire dtype {grad_dtype}")
        blocks = self.lane(lanes, lane)
        dense_layout = self._wire(lanes, lane, wire) if wire else blocks.layout
        with_tables = lane == 0 and bool(self.table_names)
        dense_at = 0 if dropped or not len(blocks.names) else aligned(len(blocks.names)) + dense_layout.nbytes
        counts = self._counts(payload, dense_at) if with_tables else TableCounts((), ())
        # Narrowed gradients (grad_wire_dtype) are narrowed everywhere: table rows travel in the wire dtype
        # too.
        rows_shapes = tuple(TableShape(t.dim, wire or t.dtype) for t in self.table_shapes)
        layout = PushLayout.of(dense_layout, not dropped, rows_shapes if with_tables else (), counts)
        if payload.size != layout.nbytes:
            raise BadRequest(
                f"a push payload of {payload.size} bytes; its counts and this pserver's plan give "
                f"{layout.nbytes}"
            )
        if dropped:
            dense, nbytes = {}, 0
        elif self._flat is not None and lanes == 1 and not wire:
            dense, nbytes = self._flat_grad(payload, layout)
        else:
            dense = self._dense(payload, layout, blocks, dense_layout, wire)
            itemsize = ITEMSIZE[wire] if wire else 0
            nbytes = sum(g.numel() * (itemsize or g.element_size()) for g in dense.values())
        nbytes += sum(part[1] for table in layout.tables for part in table)
        sparse, answer_ids = {}, {}
        graded = counts.graded or (False,) * len(layout.tables)
        for name, shape, (ids, rows, nxt), has_grad in zip(
            self.table_names, self.table_shapes, layout.tables, graded
        ):
            grad_ids = view(payload, ids, np.int64)
            if grad_ids.size and not has_grad:
                raise BadRequest(f"table {name!r}: gradient ids in a push that carries no gradient of it")
            if has_grad:
                if dropped:
                    raise BadRequest("a dropped push carries no gradients (backup_trainers)")
                grad_rows = self._rows(payload, rows, shape, wire)
                self._finite(grad_rows.numpy(), name)
                sparse[name] = self.contents.tables.shards[name].merged_gradient(grad_ids, grad_rows)
            next_ids = view(payload, nxt, np.int64)
            if next_ids.size:
                self.contents.tables.shards[name].check_ids(next_ids)
                answer_ids[name] = next_ids
        return PushParts(dense, sparse, answer_ids), nbytes

    def prefetch(self, payload: np.ndarray) -> Dict[str, np.ndarray]:
        """A prefetch payload's ids by table (every id checked to be on this shard)."""
        if not self.table_names:
            raise BadRequest("a prefetch to a pserver without distributed tables")
        counts = self._counts(payload, 0)
        if any(counts.grads) or any(counts.graded):
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

    @staticmethod
    def _rows(payload: np.ndarray, part: Tuple[int, int], shape: TableShape, wire: str) -> torch.Tensor:
        """A table's gradient rows: a view of ``part``, or widened from the wire dtype to the table's."""
        rows = torch.from_numpy(view(payload, part, _numpy_dtype(wire or shape.dtype)))
        if wire == "bfloat16":
            rows = rows.view(torch.bfloat16)
        if wire and wire != shape.dtype:
            rows = rows.to(DTYPES[shape.dtype])
        return rows.view(-1, shape.dim)

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

    def _flat_grad(self, payload: np.ndarray, layout: PushLayout) -> Tuple[FlatGrad, int]:
        """A one-lane push's dense section as the store's flat gradient (a view of the payload, its padding
        zeroed) and the bytes of its blocks: no call per block."""
        flat = self._flat
        presence = view(payload, layout.presence, np.uint8)
        if presence.size and presence.max() > 1:
            raise BadRequest("block presence bytes must be 0 or 1")
        values = payload[layout.dense[0] : layout.dense[0] + layout.dense[1]].view(flat.dtype)
        values[flat.padding] = 0
        present = presence.view(bool)
        if not self.allow_nonfinite and not np.isfinite(values).all():
            grads = FlatGrad(flat.layout, torch.from_numpy(values), present)
            for name, grad in grads.items():  # which block, to say so (absent ones may hold anything)
                if not bool(torch.isfinite(grad).all()):
                    raise BadRequest(
                        f"gradient of {name} holds NaN or Inf; push refused (nonfinite_grads='refuse')"
                    )
        nbytes = int(flat.nbytes @ presence)
        return FlatGrad(flat.layout, torch.from_numpy(values), None if present.all() else present), nbytes

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

    def in_place(self, lane: Lane) -> bool:
        """Whether an answer with ``lane``'s blocks is written in place: the store's flat buffer copied whole
        (:meth:`pserver.engine.Engine.read_flat_into`, one lane of blocks in one float dtype) and the rows
        looked up straight into the region (:meth:`lookup_into`)."""
        return self._flat is not None and self._rows_in_place and lane.names == self.lane(1, 0).names

    def lookup_into(
        self, out: np.ndarray, start: int, answer_ids: Mapping[str, np.ndarray]
    ) -> Tuple[int, int]:
        """The rows of ``answer_ids`` ({table: ids}, checked) looked up into ``out`` (uint8, an answer region)
        from byte ``start`` on, where the trainer reads them; (the end, the rows' bytes)."""
        nexts = [len(answer_ids.get(n, ())) for n in self.table_names]
        parts, end = rows_parts(self.table_shapes, nexts, start) if self.table_names else ([], start)
        nbytes = 0
        for name, shape, (at, size), n in zip(self.table_names, self.table_shapes, parts, nexts):
            if n:
                rows = out[at : at + size].view(np.dtype(shape.dtype)).reshape(n, shape.dim)
                self.contents.tables.shards[name].lookup_into(answer_ids[name], rows)
                nbytes += size
        return end, nbytes

    def answer_bytes(self, lane: Optional[Lane], answer_ids: Mapping[str, np.ndarray]) -> int:
        """Bytes of an answer with ``lane``'s blocks (None: a prefetch's, none) and the rows of
        ``answer_ids``."""
        start = lane.layout.nbytes if lane is not None else 0
        nexts = [len(answer_ids.get(n, ())) for n in self.table_names]
        return rows_parts(self.table_shapes, nexts, start)[1] if self.table_names else start

    def write(
        self,
        out: np.ndarray,
        lane: Optional[Lane],
        blocks: Sequence[Tuple[str, torch.Tensor]],
        rows: Sequence,
    ) -> int:
        """Write ``blocks`` (the lane's, in order) and ``rows`` (``(wire name, rows)`` per table asked, in
        plan order) into ``out`` (uint8, the answer region); the bytes written."""
        offsets = lane.layout.offsets if lane is not None else ()
        for (_, block), offset in zip(blocks, offsets, strict=True):
            data = _flat(block)
            out[offset : offset + data.nbytes].view(data.dtype)[:] = data
        at = lane.layout.nbytes if lane is not None else 0
        for _, r in rows:
            data = _flat(r)
            out[at : at + data.nbytes].view(data.dtype)[:] = data
            at = aligned(at + data.nbytes)
        return at

    def buffers(
        self, lane: Optional[Lane], blocks: Sequence[Tuple[str, torch.Tensor]], rows: Sequence
    ) -> List:
        """The same answer as :meth:`write`, as buffers to send in order (with the padding between parts)."""
        out: List = []
        at = 0
        offsets = lane.layout.offsets if lane is not None else ()
        for (_, block), offset in zip(blocks, offsets, strict=True):
            if offset > at:
                out.append(_ZEROS[: offset - at])
            data = _flat(block)
            out.append(data)
            at = offset + data.nbytes
        end = lane.layout.nbytes if lane is not None else 0
        if end > at:
            out.append(_ZEROS[: end - at])
        at = end
        for _, r in rows:
            data = _flat(r)
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
