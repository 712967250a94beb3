"""The chunk messages by hand: tensors cut into pieces of PushChunk / PullChunk, and pieces read back.

A tensor's first piece (offset 0) names it and carries dtype and shape; further pieces carry the next
bytes in order, each at most ``chunk_bytes`` of a message. Encoding copies each byte of tensor memory
once, into the message (or straight into a shared-memory region, :func:`encode_into`); decoding copies
none: a :class:`Piece`'s data is a memoryview of the received message. Rebuilding the tensors from the
pieces is :mod:`.reassembly`'s.
"""

from __future__ import annotations

import sys
from typing import Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch
from google.protobuf.message import DecodeError, Message

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
