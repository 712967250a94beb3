"""The gRPC client of hot standby: a primary's calls to its backup, a joining backup's calls to its primary.

:class:`ReplicaLink` implements :class:`pserver.replication.backup.Transport`
and the two calls a joining backup makes; the service answers them in
:mod:`.service.standby_calls`. Failures become the replication package's domain errors here.
"""

from __future__ import annotations

import logging
import threading
from typing import Dict, Iterator, List

import grpc

from psproto import ps_pb2
from psproto.options import channel_options
from psproto.security import Security
from psproto.wire import method_path

from ..replication.backup import ReplicaUnreachable, Transport
from ..replication.outbox import NotFollowed

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
