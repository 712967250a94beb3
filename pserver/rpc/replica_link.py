"""The gRPC side of hot standby: a primary's calls to its backup, a joining backup's calls to its primary.

:class:`ReplicaLink` implements :class:`pserver.replication.backup.Transport`
and the two calls a joining backup makes; :class:`ReplicaServicer` answers the
four replication methods of the service (Replicate, ReplicateOne, Snapshot,
Follow) and Lead. Failures become the replication package's domain errors here.
"""

from __future__ import annotations

import logging
import threading
from typing import Dict, Iterator, List

import grpc

from psproto import ps_pb2
from psproto.codec import TensorReader, decode_chunk
from psproto.options import channel_options
from psproto.security import Security
from psproto.wire import method_path

from ..errors import BadRequest, NotAllowed
from ..replication.backup import ReplicaUnreachable, Transport
from ..replication.outbox import NotFollowed
from .prologue import parse, refusals

log = logging.getLogger(__name__)


class ReplicaLink(Transport):
    """Channels to the shard's other process, one per endpoint, made on first use."""

    def __init__(self, security: Security, chunk_bytes: int):
        self.security = security
        self.chunk_bytes = chunk_bytes
        self._channels: Dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def _channel(self, endpoint: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(endpoint)
            if channel is None:
                channel = self._channels[endpoint] = self.security.channel(
                    endpoint, channel_options(self.chunk_bytes, fast_keepalive=True)
                )
            return channel

    def reconnect(self, endpoint: str) -> None:
        with self._lock:
            channel = self._channels.pop(endpoint, None)
        if channel is not None:
            channel.close()

    def send(self, endpoint: str, messages: List[bytes], timeout: float) -> int:
        """One change's messages to the backup at ``endpoint``; the seq it holds. ReplicaUnreachable if it
        did not take it."""
        channel = self._channel(endpoint)
        try:
            if len(messages) == 1:
                reply = channel.unary_unary(method_path("ReplicateOne"))(messages[0], timeout=timeout)
            else:
                reply = channel.stream_unary(method_path("Replicate"))(iter(messages), timeout=timeout)
        except grpc.RpcError as e:
            raise ReplicaUnreachable(f"{endpoint}: {e.code().name}: {e.details()}") from None
        return ps_pb2.ReplicaAck.FromString(reply).seq

    def fetch_snapshot(self, endpoint: str, request, timeout: float) -> Iterator:
        """The primary's snapshot chunks (the first carries the stream position); ConnectionError on
        failure."""
        call = self._channel(endpoint).unary_stream(
            method_path("Snapshot"),
            request_serializer=ps_pb2.SnapshotRequest.SerializeToString,
            response_deserializer=ps_pb2.SnapshotChunk.FromString,
        )
        try:
            yield from call(request, timeout=timeout)
        except grpc.RpcError as e:
            raise ConnectionError(f"snapshot from {endpoint}: {e.code().name}: {e.details()}") from None

    def follow(self, endpoint: str, request, timeout: float) -> None:
        """Ask the primary at ``endpoint`` for the changes since the snapshot; ConnectionError on failure."""
        call = self._channel(endpoint).unary_unary(
            method_path("Follow"),
            request_serializer=ps_pb2.FollowRequest.SerializeToString,
            response_deserializer=ps_pb2.FollowReply.FromString,
        )
        try:
            call(request, timeout=timeout)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.OUT_OF_RANGE:  # OutOfSync: that primary dropped this backup
                raise NotFollowed(f"follow {endpoint}: {e.details()}") from None
            raise ConnectionError(f"follow {endpoint}: {e.code().name}: {e.details()}") from None

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()


class ReplicaServicer:
    """Replicate / ReplicateOne / Snapshot / Follow / Lead, answered by the pserver's :class:`Replica`.

    Reads the :class:`~pserver.rpc.servicer.PserverServicer` it serves beside at each call: its
    ``replica`` (None on a pserver without replicas: Lead then answers that it leads, at epoch 0,
    and the others refuse), engine, contents (what a replication message may carry), endpoint
    and counters.
    """

    def __init__(self, servicer):
        self.servicer = servicer

    @property
    def replica(self):
        return self.servicer.replica

    @property
    def engine(self):
        return self.servicer.engine

    @property
    def endpoint(self) -> str:
        return self.servicer.endpoint

    @property
    def counters(self):
        return self.servicer.counters

    def _replica(self):
        if self.replica is None:
            raise NotAllowed(f"pserver {self.endpoint} has no replicas (server_replicas=1)")
        return self.replica

    def _receive(self, messages) -> bytes:
        header, reader = None, TensorReader(self.servicer.contents.expect)
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
            return ps_pb2.LeadReply(
                role="primary", primary=self.endpoint, step=self.engine.step
            ).SerializeToString()
        return self.replica.lead_reply().SerializeToString()

    def handlers(self) -> dict:
        return {
            "Replicate": grpc.stream_unary_rpc_method_handler(self.Replicate),
            "ReplicateOne": grpc.unary_unary_rpc_method_handler(self.ReplicateOne),
            "Snapshot": grpc.unary_stream_rpc_method_handler(self.Snapshot),
            "Follow": grpc.unary_unary_rpc_method_handler(self.Follow),
            "Lead": grpc.unary_unary_rpc_method_handler(self.Lead),
        }
