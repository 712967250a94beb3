"""The wire contract both sides name: the service, the path of each of its methods, and one-message requests.

Trainers, pservers and a pserver's link to its backup build their calls from
here, so the service's name and its methods' paths are written once. Tensors
travel as :mod:`psproto.codec` encodes them; a request (or answer) of at most
:data:`~psproto.codec.ONE_MESSAGE_BYTES` of tensor data may go as one message
(:func:`one_message`) instead of a stream of chunks.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from . import ps_pb2
from .codec import ONE_MESSAGE_BYTES, encode_chunks

__all__ = ["SERVICE", "METHODS", "ONE_MESSAGE_BYTES", "TRAINER_METADATA", "method_path", "one_message"]

SERVICE = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"].full_name
METHODS = frozenset(m.name for m in ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"].methods)
# The metadata key every trainer call carries "<trainer id>:<incarnation>" under: the pserver notes the call
# as a sign of life of the process holding the id's session on arrival, before it waits for a handler thread
# (pserver/rpc/arrival.py).
TRAINER_METADATA = "ps-trainer"


def method_path(name: str) -> str:
    """``/<service>/<name>``: the path a call to method ``name`` goes to; KeyError for a method ps.proto
    lacks."""
    if name not in METHODS:
        raise KeyError(f"{SERVICE} has no method {name!r} (ps.proto defines {sorted(METHODS)})")
    return f"/{SERVICE}/{name}"


def one_message(header, tensors: Sequence[Tuple[str, torch.Tensor]], nbytes: Optional[int] = None) -> bytes:
    """``header`` and ``tensors`` encoded as a single message (``nbytes``: their tensor bytes, when known)."""
    if nbytes is None:
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    (message,) = encode_chunks(header, tensors, nbytes + 1)  # room never runs out: one message
    return message
