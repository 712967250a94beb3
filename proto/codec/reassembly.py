"""Tensors rebuilt from pieces: each checked against what is expected, widened from a narrower wire dtype.

:class:`TensorReader` takes the :class:`~.chunks.Piece` values :func:`~.chunks.decode_chunk` gives (or
protobuf's ``TensorPiece``) in stream order and writes their bytes into the tensors they make up: a
destination given (a trainer's parameters, a pserver's pooled buffer) or fresh ones. A pushed gradient
may travel narrower than its block (``grad_wire_dtype``): its pieces hold whole elements, widened into
the block's dtype as they arrive (:func:`widen`).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..dtypes import DTYPES
from .chunks import WireError, as_bytes

# expect(name): (dtype, shape) of a known tensor name, None for an unknown one.
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
