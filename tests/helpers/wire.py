"""Raw requests to a pserver, below the Trainer: encoded pushes and refusal checks."""
from __future__ import annotations

import grpc
import pytest

from psproto import ps_pb2
from psproto.codec import encode_chunks


def push_messages(digest, trainer_id=0, step=0, tensors=(), header=True):
    """PushChunk messages as the generated protobuf classes see the codec's encoding."""
    h = ps_pb2.PushHeader(trainer_id=trainer_id, step=step, layout_digest=digest)
    msgs = [ps_pb2.PushChunk.FromString(b) for b in encode_chunks(h, list(tensors), 1 << 16)]
    if not header:
        msgs[0].ClearField("header")
    return iter(msgs)


def expect_refusal(call, code, match):
    """Run ``call``; assert it fails with gRPC status ``code`` and details containing ``match``."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == code, info.value.details()
    assert match in info.value.details(), info.value.details()
    return info.value.details()
