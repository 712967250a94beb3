"""The replication calls of the service: hot standby's calls between a shard's two processes, and Lead.

A primary sends its backup every change (Replicate, ReplicateOne); a joining backup copies the primary's
state (Snapshot) and asks for the changes since (Follow); anyone asks who leads (Lead). Answered by the
process's :class:`~pserver.replication.replica.Replica`; the client side is
:class:`~..replica_link.ReplicaLink`.
"""

from __future__ import annotations

from typing import Dict

import grpc

from psproto import ps_pb2
from psproto.codec import TensorReader, decode_chunk

from ...engine import Contents, Engine
from ...errors import BadRequest, NotAllowed
from ..counters import Counters
from ..prologue import parse, refusals


class StandbyCalls:
    """Replicate / ReplicateOne / Snapshot / Follow / Lead, answered by the pserver's :class:`Replica`.

    ``replica`` is None on a pserver without replicas: Lead then answers that it leads, at epoch 0, and
    the others refuse. ``contents`` says what a replication message may carry; ``layout_epoch`` the
    layout this process serves (Lead says it).
    """

    def __init__(
        self, replica, engine: Engine, contents: Contents, counters: Counters, layout_epoch: int = 0
    ):
        self.replica = replica
        self.layout_epoch = layout_epoch
        self.engine = engine
        self.contents = contents
        self.counters = counters
        self.endpoint = engine.endpoint

    def _replica(self):
        if self.replica is None:
            raise NotAllowed(f"pserver {self.endpoint} has no replicas (server_replicas=1)")
        return self.replica

    def _receive(self, messages) -> bytes:
        header, reader = None, TensorReader(self.contents.expect)
        for data in messages:
            extra, pieces = decode_chunk(data, ps_pb2.ReplicaHeader)
            if extra is not None:
                header = extra
            for piece in pieces:
                reader.add(piece)
        if header is None:
            raise BadRequest("a replication message must open with its header")
        seq = self._replica().receive(header, reader.finish())
        return ps_pb2.ReplicaAck(seq=seq).SerializeToString()

    @refusals
    def Replicate(self, request_iterator, context) -> bytes:
        return self._receive(request_iterator)

    @refusals
    def ReplicateOne(self, data, context) -> bytes:
        return self._receive((data,))

    @refusals
    def Snapshot(self, data, context):
        request = parse(ps_pb2.SnapshotRequest, data)
        for chunk in self._replica().serve_snapshot(request):
            yield chunk.SerializeToString()

    @refusals
    def Follow(self, data, context) -> bytes:
        self._replica().follow(parse(ps_pb2.FollowRequest, data))
        return ps_pb2.FollowReply().SerializeToString()

    @refusals
    def Lead(self, data, context) -> bytes:
        parse(ps_pb2.LeadRequest, data)
        if self.replica is None:
            reply = ps_pb2.LeadReply(role="primary", primary=self.endpoint, step=self.engine.step)
        else:
            reply = self.replica.lead_reply()
        # Leading or not, a process of a later layout tells a trainer of an earlier one where the job went
        # (its Hello answers "moved"): a shard of the next layout may have no primary for a while.
        reply.layout_epoch = self.layout_epoch
        return reply.SerializeToString()

    def handlers(self) -> Dict[str, grpc.RpcMethodHandler]:
        """These calls' handlers by method name (raw bytes both ways)."""
        return {
            "Replicate": grpc.stream_unary_rpc_method_handler(self.Replicate),
            "ReplicateOne": grpc.unary_unary_rpc_method_handler(self.ReplicateOne),
            "Snapshot": grpc.unary_stream_rpc_method_handler(self.Snapshot),
            "Follow": grpc.unary_unary_rpc_method_handler(self.Follow),
            "Lead": grpc.unary_unary_rpc_method_handler(self.Lead),
        }
