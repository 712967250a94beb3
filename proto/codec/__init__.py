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

Two modules: :mod:`.chunks` encodes and decodes the chunk messages (tensors cut into pieces, and pieces
read back as views of the message), :mod:`.reassembly` rebuilds tensors from the pieces
(:class:`TensorReader`: checked against what is expected, widened from a narrower wire dtype).
"""

from .chunks import (
    ONE_MESSAGE_BYTES,
    Piece,
    WireError,
    as_bytes,
    decode_chunk,
    encode_chunks,
    encode_into,
    message_limit,
)
from .reassembly import MAX_VARIABLE_BYTES, NARROWER, Expect, TensorReader, widen

__all__ = [
    "ONE_MESSAGE_BYTES",
    "MAX_VARIABLE_BYTES",
    "NARROWER",
    "Expect",
    "Piece",
    "TensorReader",
    "WireError",
    "as_bytes",
    "decode_chunk",
    "encode_chunks",
    "encode_into",
    "message_limit",
    "widen",
]
