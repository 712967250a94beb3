"""Tensors on the wire: cut into pieces on the way out, checked and reassembled on the way in.

A tensor travels as raw little-endian bytes. Its first piece (offset 0) names
it and carries dtype and shape; further pieces carry the next bytes in order.
Pieces of several tensors share a message until it holds ``chunk_bytes``, so
a bias costs no message of its own and a 500 MB weight streams in 1 MB steps.
"""
from __future__ import annotations

import sys
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from psproto import ps_pb2

if sys.byteorder != "little":  # the wire format is little-endian raw memory
    raise ImportError("psproto.codec needs a little-endian host")

WIRE_DTYPES = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32,
}


class WireError(ValueError):
    """A stream of pieces that does not describe the tensors it should."""


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU tensor's memory (no copy)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()


def iter_pieces(tensors: Iterable[Tuple[str, torch.Tensor]],
                chunk_bytes: int) -> Iterator[List[ps_pb2.TensorPiece]]:
    """Yield lists of pieces, each list holding at most ``chunk_bytes`` of data.

    Tensors are sent in the order given; each is read at the moment its
    pieces are produced, so callers may stream straight from live memory
    when nothing writes to it meanwhile.
    """
    batch: List[ps_pb2.TensorPiece] = []
    room = chunk_bytes
    for name, tensor in tensors:
        raw = _as_bytes(tensor)
        dtype = str(tensor.dtype).replace("torch.", "")
        offset, total = 0, raw.nbytes
        first = True
        while first or offset < total:
            n = min(room, total - offset)
            piece = ps_pb2.TensorPiece(offset=offset, data=raw[offset:offset + n].tobytes())
            if first:
                piece.name = name
                piece.dtype = dtype
                piece.shape.extend(tensor.shape)
                first = False
            batch.append(piece)
            offset += n
            room -= n
            if room <= 0:
                yield batch
                batch, room = [], chunk_bytes
    if batch:
        yield batch


Expect = Callable[[str], Optional[Tuple[str, Sequence[int]]]]


class TensorReader:
    """Rebuilds tensors from pieces, checking each against what is expected.

    ``expect(name)`` returns ``(dtype, shape)`` for a known tensor name or
    None for an unknown one. ``dest(name)``, if given, returns the contiguous
    tensor to fill in place (a trainer pulling straight into its parameters);
    otherwise fresh tensors are allocated. Any inconsistency raises
    :class:`WireError` with a message naming the tensor.
    """

    def __init__(self, expect: Expect, dest: Optional[Callable[[str], torch.Tensor]] = None):
        self._expect = expect
        self._dest = dest
        self._tensors: Dict[str, torch.Tensor] = {}
        self._buffers: Dict[str, np.ndarray] = {}
        self._filled: Dict[str, int] = {}
        self._current: Optional[str] = None
        self.nbytes = 0

    def add(self, piece: ps_pb2.TensorPiece) -> None:
        data = piece.data
        if piece.offset == 0 and piece.name:
            self._open(piece)
        elif self._current is None:
            raise WireError("a tensor piece arrived before any tensor was opened")
        name = self._current
        buf = self._buffers[name]
        filled = self._filled[name]
        if piece.offset != filled:
            raise WireError(f"tensor {name!r}: piece at byte {piece.offset}, expected byte {filled}")
        end = filled + len(data)
        if end > buf.nbytes:
            raise WireError(f"tensor {name!r}: {end} bytes sent, it holds only {buf.nbytes}")
        if data:
            buf[filled:end] = np.frombuffer(data, dtype=np.uint8)
        self._filled[name] = end
        self.nbytes += len(data)

    def _open(self, piece: ps_pb2.TensorPiece) -> None:
        self._close_current()
        name = piece.name
        if name in self._tensors:
            raise WireError(f"tensor {name!r} sent twice in one stream")
        expected = self._expect(name)
        if expected is None:
            raise WireError(f"unknown tensor {name!r}")
        dtype, shape = expected
        if piece.dtype != dtype:
            raise WireError(f"tensor {name!r}: dtype {piece.dtype!r}, expected {dtype!r}")
        if list(piece.shape) != list(shape):
            raise WireError(f"tensor {name!r}: shape {list(piece.shape)}, expected {list(shape)}")
        if self._dest is not None:
            tensor = self._dest(name)
            if not tensor.is_contiguous() or tensor.device.type != "cpu":
                raise WireError(f"tensor {name!r}: destination must be a contiguous CPU tensor")
        else:
            tensor = torch.empty(list(shape), dtype=WIRE_DTYPES[dtype])
        self._tensors[name] = tensor
        self._buffers[name] = _as_bytes(tensor)
        self._filled[name] = 0
        self._current = name

    def _close_current(self) -> None:
        name = self._current
        if name is not None and self._filled[name] != self._buffers[name].nbytes:
            raise WireError(f"tensor {name!r}: stream moved on after {self._filled[name]} of "
                            f"{self._buffers[name].nbytes} bytes")

    def finish(self) -> Dict[str, torch.Tensor]:
        """Check the last tensor is complete and return every tensor by name."""
        self._close_current()
        self._current = None
        return self._tensors
