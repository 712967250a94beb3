"""Raw requests to a pserver, below the Trainer: sessions, encoded pushes and refusal checks."""

from __future__ import annotations

import secrets
from typing import Dict, Iterable, Optional

import grpc
import pytest

from psproto import ps_pb2
from psproto.codec import encode_chunks


def hello(stub, digest: str, trainer_id: int = 0, incarnation: Optional[int] = None) -> str:
    """Say Hello for ``trainer_id`` as a trainer process does; returns the session every later call
    carries."""
    incarnation = incarnation if incarnation is not None else secrets.randbits(63) | 1
    request = ps_pb2.HelloRequest(trainer_id=trainer_id, layout_digest=digest, incarnation=incarnation)
    return stub.Hello(request, timeout=10).session


def open_sessions(stub, digest: str, trainer_ids: Iterable[int] = (0, 1)) -> Dict[int, str]:
    """{trainer id: session} after a Hello for each of ``trainer_ids``."""
    return {t: hello(stub, digest, t) for t in trainer_ids}


def push_messages(digest, trainer_id=0, step=0, tensors=(), header=True, sessions=None, session=None):
    """PushChunk messages as the generated protobuf classes see the codec's encoding.

    The header carries ``session``, else ``sessions[trainer_id]``, else none.
    """
    if session is None:
        session = (sessions or {}).get(trainer_id, "")
    h = ps_pb2.PushHeader(trainer_id=trainer_id, step=step, layout_digest=digest, session=session)
    msgs = [ps_pb2.PushChunk.FromString(b) for b in encode_chunks(h, list(tensors), 1 << 16)]
    if not header:
        msgs[0].ClearField("header")
    return iter(msgs)


def answer(call) -> ps_pb2.PullHeader:
    """The header (counted, step) of a started PushPull's answer, read to its end.

    ``stub.PushPull(messages)`` sends the push at once; a sync step's answer
    comes once every trainer pushed it, so start each trainer's call first.
    """
    return list(call)[0].header


def expect_refusal(call, code, match):
    """Run ``call``; assert it fails with gRPC status ``code`` and details containing ``match``."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == code, info.value.details()
    assert match in info.value.details(), info.value.details()
    return info.value.details()
