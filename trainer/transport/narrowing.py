"""Gradients narrowed to the wire dtype before a push (``grad_wire_dtype``).

Where moving bytes costs CPU (gRPC Python encodes, copies and decodes every
byte on both sides), a push in bfloat16 costs half of one in float32. Only
the gradient is rounded, once per trainer and step: the pservers widen each
piece back on arrival (``psproto.codec.TensorReader(widen=True)``) and keep
float32 master parameters and optimizer state, and pulls stay exact.
"""

from __future__ import annotations

from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from psproto.dtypes import DTYPES

Named = Tuple[str, torch.Tensor]


class GradientNarrower:
    """Casts pushed float tensors wider than the wire dtype into it, in reused buffers.

    A buffer per (pserver, tensor) is filled in place each step rather than
    allocated: a fresh allocation of a large block costs page faults worth
    several casts. So a tensor handed out stays valid only until the next
    push of the same name to the same pserver, which is how pushes go (one
    in flight per pserver; a retry resends the same step).
    """

    def __init__(self, wire_dtype: Optional[str]):
        """``wire_dtype``: a name of :data:`psproto.dtypes.DTYPES`, or None to send as computed."""
        self.dtype = None if wire_dtype is None else DTYPES[wire_dtype]
        self._buffers: Dict[Tuple[str, str], torch.Tensor] = {}

    def _narrowed(self, endpoint: str, name: str, t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point() or t.element_size() <= self.dtype.itemsize:
            return t  # ids, and gradients already as narrow as the wire
        key = (endpoint, name)
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape:
            buf = self._buffers[key] = torch.empty(t.shape, dtype=self.dtype)
        return buf.copy_(t)

    def narrow(self, endpoint: str, tensors: List[Named]) -> List[Named]:
        """``tensors`` for a push to ``endpoint``, float ones cast to the wire dtype."""
        if self.dtype is None:
            return tensors
        return [(name, self._narrowed(endpoint, name, t)) for name, t in tensors]

    def narrow_stream(self, endpoint: str, tensors: Iterable[Named]) -> Iterator[Named]:
        """As :meth:`narrow`, for tensors that come one by one (a push streamed during backward)."""
        for name, t in tensors:
            yield name, (t if self.dtype is None else self._narrowed(endpoint, name, t))
