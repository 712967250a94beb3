"""Tensors on the wire: cut into pieces on the way out, checked and reassembled on the way in.

A tensor travels as raw little-endian bytes. Its first piece (offset 0) names
it and carries dtype and shape; further pieces carry the next bytes in order.
Pieces of several tensors share a message until it holds ``chunk_bytes``, so
a bias costs no message of its own and a 500 MB weight streams in 1 MB steps.

The bulk messages (``PushChunk``, ``PullChunk``: header = field 1, pieces =
field 2) are encoded and decoded here by hand, in exactly the protobuf wire
format ps.proto declares, so any protobuf client can speak to a pserver.
Doing it by hand saves the copies the generic path makes: encoding copies
each byte of tensor memory once, into the message; decoding copies none (a
piece's data is a memoryview of the received message) until the reader
copies it into its destination. A pushed gradient may travel narrower than
its block (bfloat16 or float16 for float32, ``grad_wire_dtype``); pieces then
hold whole elements, and the pserver's reader widens each into the block's
dtype as it arrives.
"""

from __future__ import annotations

import sys
from typing import Callable, Dict, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch
from google.protobuf.message import DecodeError, Message

from .dtypes import DTYPES

if sys.byteorder != "little":  # the wire format is little-endian raw memory
    raise ImportError("psproto.codec needs a little-endian host")


# A request whose tensors hold at most this many bytes travels as one message
# (gRPC's default message size), however small ``chunk_bytes`` is.
ONE_MESSAGE_BYTES = 4 << 20


def message_limit(chunk_bytes: int) -> int:
    """Largest message either side accepts: a chunk or a one-message request, plus headroom."""
    return max(2 * chunk_bytes, ONE_MESSAGE_BYTES) + (1 << 20)


# Field numbers shared by PushChunk and PullChunk, and of TensorPiece.
_HEADER, _PIECES = 1, 2
_NAME, _DTYPE, _SHAPE, _OFFSET, _DATA = 1, 2, 3, 4, 5
_VARINT, _LEN = 0, 2
_MASK64 = (1 << 64) - 1
_MAX_FIELD = 1 << 29


class WireError(ValueError):
    """A message or stream of pieces that does not describe the tensors it should."""


class Piece(NamedTuple):
    """A decoded TensorPiece; ``data`` is a view into the received message."""

    name: str
    dtype: str
    shape: Tuple[int, ...]
    offset: int
    data: memoryview


def as_bytes(t: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU tensor's memory (no copy)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()


# -- encoding -----------------------------------------------------------------


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # int64 negatives as two's complement, as protobuf does
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _len_field(field: int, payload_len: int) -> bytes:
    return _varint((field << 3) | _LEN) + _varint(payload_len)


def _piece_meta(name: str, dtype: str, shape: Sequence[int], offset: int) -> bytes:
    parts = []
    if name:
        raw = name.encode("utf-8")
        parts += [_len_field(_NAME, len(raw)), raw]
        raw = dtype.encode("ascii")
        parts += [_len_field(_DTYPE, len(raw)), raw]
        packed = b"".join(_varint(d) for d in shape)
        if packed:
            parts += [_len_field(_SHAPE, len(packed)), packed]
    if offset:
        parts += [_varint((_OFFSET << 3) | _VARINT), _varint(offset)]
    return b"".join(parts)


def encode_chunks(
    header: Message, tensors: Iterable[Tuple[str, torch.Tensor]], chunk_bytes: int
) -> Iterator[bytes]:
    """Yield encoded PushChunk/PullChunk messages: ``header`` in the first, then pieces.

    Each message holds at most ``chunk_bytes`` of tensor data. Tensors are
    read at the moment their pieces are encoded, so callers may stream from
    live memory when nothing writes to it meanwhile. Always yields at least
    one message (the header), even for no tensors.
    """
    for parts in _chunk_parts(header, tensors, chunk_bytes):
        yield b"".join(parts)


def encode_into(buf: memoryview, header: Message, tensors: Sequence[Tuple[str, torch.Tensor]]) -> int:
    """Encode ``header`` and ``tensors`` as one message written into ``buf`` from byte 0; its length.

    The tensors' bytes are copied once, straight into ``buf`` (a shared-memory
    region). Returns -1, writing nothing, when the message would not fit.
    """
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    (parts,) = _chunk_parts(header, tensors, nbytes + 1)  # room never runs out: one message
    if sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts) > len(buf):
        return -1
    pos = 0
    for p in parts:
        n = len(p) if isinstance(p, bytes) else p.nbytes
        buf[pos : pos + n] = p
        pos += n
    return pos


def _chunk_parts(
    header: Message, tensors: Iterable[Tuple[str, torch.Tensor]], chunk_bytes: int
) -> Iterator[List[object]]:
    """The parts (bytes, and memoryviews of tensor memory) of each message :func:`encode_chunks` yields."""
    head = header.SerializeToString()
    parts: List[object] = [_len_field(_HEADER, len(head)), head]
    room = chunk_bytes
    for name, tensor in tensors:
        raw = as_bytes(tensor)
        dtype = str(tensor.dtype).replace("torch.", "")
        itemsize = tensor.element_size()
        offset, total = 0, raw.nbytes
        first = True
        while first or offset < total:
            if room < itemsize and offset < total:  # no room for one element: it opens the next message
                yield parts
                parts, room = [], chunk_bytes
            n = min(room, total - offset)
            if n < total - offset:
                n -= n % itemsize  # whole elements per piece, so a narrowed gradient widens piece by piece
            meta = _piece_meta(name if first else "", dtype, tensor.shape, offset)
            data_key = _len_field(_DATA, n)
            parts += [
                _len_field(_PIECES, len(meta) + len(data_key) + n),
                meta,
                data_key,
                raw[offset : offset + n].data,
            ]
            first = False
            offset += n
            room -= n
            if room <= 0:
                yield parts
                parts, room = [], chunk_bytes
    if parts:
        yield parts


# -- decoding -----------------------------------------------------------------


def _read_varint(buf: bytes, pos: int, end: int) -> Tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end:
            raise WireError("message truncated inside a varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result & _MASK64, pos  # bits past 64 are dropped, as protobuf does
        shift += 7
        if shift >= 70:
            raise WireError("malformed varint")


def _fields(buf: bytes, pos: int, end: int) -> Iterator[Tuple[int, int, int, int]]:
    """(field, wire type, value or start, end) for each field of buf[pos:end]."""
    while pos < end:
        start = pos
        key, pos = _read_varint(buf, pos, end)
        field, wire = key >> 3, key & 7
        # What protobuf refuses, refused too: a key of more than 5 bytes, field number 0 or >= 2**29.
        if pos - start > 5 or not 0 < field < _MAX_FIELD:
            raise WireError(f"malformed field key at byte {start}")
        if wire == _VARINT:
            value, pos = _read_varint(buf, pos, end)
            yield field, wire, value, pos
        elif wire == _LEN:
            start = pos
            n, pos = _read_varint(buf, pos, end)
            if pos - start > 5 or n >= 1 << 31:
                raise WireError(f"malformed length of field {field} at byte {start}")
            if pos + n > end:
                raise WireError("message truncated inside a length-delimited field")
            yield field, wire, pos, pos + n
            pos += n
        elif wire in (1, 5):  # fixed64 / fixed32: not in our messages, skip as protobuf does
            pos += 8 if wire == 1 else 4
            if pos > end:
                raise WireError("message truncated inside a fixed-width field")
        else:
            raise WireError(f"unsupported protobuf wire type {wire} (field {field})")


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _decode_piece(buf: bytes, view: memoryview, pos: int, end: int) -> Piece:
    name, dtype, shape, offset, data = "", "", [], 0, view[0:0]
    try:
        for field, wire, a, b in _fields(buf, pos, end):
            if field == _NAME and wire == _LEN:
                name = bytes(view[a:b]).decode("utf-8")
            elif field == _DTYPE and wire == _LEN:
                dtype = bytes(view[a:b]).decode("utf-8")
            elif field == _SHAPE and wire == _LEN:  # packed
                p = a
                while p < b:
                    d, p = _read_varint(buf, p, b)
                    shape.append(_signed(d))
            elif field == _SHAPE and wire == _VARINT:  # unpacked, also legal
                shape.append(_signed(a))
            elif field == _OFFSET and wire == _VARINT:
                offset = a
            elif field == _DATA and wire == _LEN:
                data = view[a:b]
    except UnicodeDecodeError as e:
        raise WireError(f"tensor piece with a malformed name or dtype: {e}") from None
    return Piece(name, dtype, tuple(shape), offset, data)


def decode_chunk(buf: bytes, header_type: type) -> Tuple[Optional[Message], List[Piece]]:
    """Decode one PushChunk/PullChunk message into (header or None, pieces).

    ``buf`` may be a memoryview (of a shared-memory region): it is read in
    place, and the pieces' data are views of it. Raises :class:`WireError`
    for bytes that are not such a message.
    """
    if not isinstance(buf, (bytes, memoryview)):
        buf = bytes(buf)
    view = memoryview(buf)
    header, pieces = None, []
    for field, wire, a, b in _fields(buf, 0, len(buf)):
        if field == _HEADER and wire == _LEN:
            try:
                # A message field that occurs more than once is merged, as protobuf does.
                if header is None:
                    header = header_type()
                header.MergeFromString(bytes(view[a:b]))
            except DecodeError as e:
                raise WireError(f"malformed {header_type.__name__}: {e}") from None
        elif field == _PIECES and wire == _LEN:
            pieces.append(_decode_piece(buf, view, a, b))
    return header, pieces


Expect = Callable[[str], Optional[Tuple[str, Sequence[int]]]]


# A gradient may travel narrower than its block (DistributeTranspilerConfig.grad_wire_dtype):
# the wire dtypes a reader that widens accepts for each block dtype.
NARROWER = {"float32": ("bfloat16", "float16"), "float64": ("bfloat16", "float16", "float32")}
_NUMPY = {"float16": np.float16, "float32": np.float32}


def widen(data: memoryview, wire: str, out: np.ndarray) -> None:
    """Write the ``wire``-dtype values in ``data`` into ``out`` (float32 or float64 elements), exactly."""
    if wire == "bfloat16":
        bits = np.frombuffer(data, np.uint16)
        if out.dtype == np.float32:  # a bfloat16 is the top half of the float32 of the same value
            np.left_shift(bits, 16, out=out.view(np.uint32), dtype=np.uint32, casting="unsafe")
        else:
            np.copyto(out, (bits.astype(np.uint32) << 16).view(np.float32))
    else:
        np.copyto(out, np.frombuffer(data, _NUMPY[wire]))


# Largest tensor of a free row count (ids, table rows) one stream may carry:
# the sender's claim is checked before anything is allocated.
MAX_VARIABLE_BYTES = 2 << 30


class TensorReader:
    """Rebuilds tensors from pieces, checking each against what is expected.

    ``expect(name)`` returns ``(dtype, shape)`` for a known tensor name or
    None for an unknown one; a shape whose dim 0 is -1 accepts any row count
    (up to :data:`MAX_VARIABLE_BYTES`) and always gets a fresh tensor.
    ``dest(name)``, if given, returns the contiguous CPU tensor to fill in
    place for fixed shapes (a trainer's parameters, a pserver's pooled
    buffer); otherwise fresh tensors are allocated. ``widen``: a float tensor
    may arrive in a narrower dtype of :data:`NARROWER` (pushed gradients) and
    is widened into its expected dtype piece by piece, with no staging copy;
    its pieces must then hold whole elements. Any inconsistency raises
    :class:`WireError` with a message naming the tensor.
    """

    def __init__(
        self, expect: Expect, dest: Optional[Callable[[str], torch.Tensor]] = None, widen: bool = False
    ):
        self._expect = expect
        self._dest = dest
        self._widen = widen
        self.tensors: Dict[str, torch.Tensor] = {}
        # Per open tensor: its memory as bytes, or (narrowed) as elements; bytes expected; bytes received.
        self._buffers: Dict[str, np.ndarray] = {}
        self._total: Dict[str, int] = {}
        self._filled: Dict[str, int] = {}
        self._narrowed: Dict[str, Tuple[str, int]] = {}  # name: (wire dtype, its itemsize)
        self._current: Optional[str] = None
        self.nbytes = 0

    def add(self, piece) -> None:
        """Take one piece (a :class:`Piece` or a ``ps_pb2.TensorPiece``)."""
        data = piece.data
        if piece.offset == 0 and piece.name:
            self._open(piece)
        elif self._current is None:
            raise WireError("a tensor piece arrived before any tensor was opened")
        elif piece.name and piece.name != self._current:
            # Later pieces carry only bytes; one that names another tensor is not ours to guess.
            raise WireError(
                f"a piece of tensor {piece.name!r} at byte {piece.offset}, but tensor "
                f"{self._current!r} is open (a tensor opens with its piece at byte 0)"
            )
        name = self._current
        buf = self._buffers[name]
        filled = self._filled[name]
        if piece.offset != filled:
            raise WireError(f"tensor {name!r}: piece at byte {piece.offset}, expected byte {filled}")
        n = len(data)
        end = filled + n
        if end > self._total[name]:
            raise WireError(f"tensor {name!r}: {end} bytes sent, it holds only {self._total[name]}")
        if n:
            narrowed = self._narrowed.get(name)
            if narrowed is None:
                buf[filled:end] = np.frombuffer(data, dtype=np.uint8)
            else:
                wire, k = narrowed
                if filled % k or n % k:
                    raise WireError(
                        f"tensor {name!r} sent as {wire}: a piece of {n} bytes at byte {filled} "
                        f"cuts an element"
                    )
                widen(data, wire, buf[filled // k : end // k])
        self._filled[name] = end
        self.nbytes += n

    def _open(self, piece) -> None:
        self._close_current()
        name = piece.name
        if name in self.tensors:
            raise WireError(f"tensor {name!r} sent twice in one stream")
        expected = self._expect(name)
        if expected is None:
            raise WireError(f"unknown tensor {name!r}")
        dtype, shape = expected
        narrowed = piece.dtype != dtype and self._widen and piece.dtype in NARROWER.get(dtype, ())
        if piece.dtype != dtype and not narrowed:
            also = f" or one of {NARROWER[dtype]}" if self._widen and dtype in NARROWER else ""
            raise WireError(f"tensor {name!r}: dtype {piece.dtype!r}, expected {dtype!r}{also}")
        variable = bool(shape) and shape[0] == -1
        if variable:
            shape = self._variable_shape(name, piece, shape, dtype)
        elif list(piece.shape) != list(shape):
            raise WireError(f"tensor {name!r}: shape {list(piece.shape)}, expected {list(shape)}")
        if self._dest is not None and not variable:
            tensor = self._dest(name)
            if not tensor.is_contiguous() or tensor.device.type != "cpu":
                raise WireError(f"tensor {name!r}: destination must be a contiguous CPU tensor")
        else:
            tensor = torch.empty(list(shape), dtype=DTYPES[dtype])
        self.tensors[name] = tensor
        if narrowed:
            k = DTYPES[piece.dtype].itemsize
            self._narrowed[name] = (piece.dtype, k)
            self._buffers[name] = tensor.detach().reshape(-1).numpy()
            self._total[name] = tensor.numel() * k
        else:
            self._buffers[name] = as_bytes(tensor)
            self._total[name] = self._buffers[name].nbytes
        self._filled[name] = 0
        self._current = name

    @staticmethod
    def _variable_shape(name: str, piece, shape: Sequence[int], dtype: str) -> List[int]:
        """The sent shape of a tensor whose dim 0 is free (-1), checked against the rest."""
        sent = list(piece.shape)
        if len(sent) != len(shape) or sent[1:] != list(shape[1:]) or sent[0] < 0:
            raise WireError(
                f"tensor {name!r}: shape {sent}, expected [n{''.join(f', {d}' for d in shape[1:])}]"
            )
        nbytes = DTYPES[dtype].itemsize  # what it takes here, however narrow it travels
        for d in sent:
            nbytes *= d
        if nbytes > MAX_VARIABLE_BYTES:
            raise WireError(
                f"tensor {name!r}: {nbytes:,} bytes is more than one request may carry "
                f"({MAX_VARIABLE_BYTES:,}); send fewer rows per request"
            )
        return sent

    def _close_current(self) -> None:
        name = self._current
        if name is not None and self._filled[name] != self._total[name]:
            raise WireError(
                f"tensor {name!r}: stream moved on after {self._filled[name]} of {self._total[name]} bytes"
            )

    def finish(self) -> Dict[str, torch.Tensor]:
        """Check the last tensor is complete and return every tensor by name."""
        self._close_current()
        self._current = None
        return self.tensors
