"""Connection: one gRPC channel to one process of a pserver's shard, and the calls a trainer makes over it."""

from __future__ import annotations

from typing import Dict

import grpc

from psproto import ps_pb2
from psproto.wire import method_path

from .shared_regions import RegionPool
from .wire_paths import (
    DURING_BACKWARD,
    ONE_MESSAGE,
    SHARED_MEMORY,
    STREAM,
    DuringBackwardPath,
    OneMessagePath,
    SharedMemoryPath,
    StreamPath,
    WirePath,
)

# The calls without tensors: method -> (request type, answer type).
UNARY = {
    "Hello": (ps_pb2.HelloRequest, ps_pb2.HelloReply),
    "Close": (ps_pb2.CloseRequest, ps_pb2.CloseReply),
    "Heartbeat": (ps_pb2.HeartbeatRequest, ps_pb2.HeartbeatReply),
    "Restore": (ps_pb2.RestoreRequest, ps_pb2.RestoreReply),
    "Checkpoint": (ps_pb2.CheckpointRequest, ps_pb2.CheckpointReply),
    "SaveTables": (ps_pb2.SaveTablesRequest, ps_pb2.SaveTablesReply),
    "Reduce": (ps_pb2.ReduceRequest, ps_pb2.ReduceReply),
    "Claim": (ps_pb2.ClaimRequest, ps_pb2.ClaimReply),
    "Stats": (ps_pb2.StatsRequest, ps_pb2.StatsReply),
}


class Connection:
    """The calls over ``channel`` (to the process a pserver's calls go to now): unary, pull, and the wire
    paths.

    PushPull, Pull and Prefetch carry tensor bytes, encoded and decoded by :mod:`psproto.codec` (the same
    wire format, fewer copies): their calls pass raw bytes.
    """

    def __init__(self, channel: grpc.Channel, chunk_bytes: int, regions: RegionPool, endpoint: str):
        self.channel = channel
        self.unary = {
            name: channel.unary_unary(
                method_path(name),
                request_serializer=request.SerializeToString,
                response_deserializer=answer.FromString,
            )
            for name, (request, answer) in UNARY.items()
        }
        self.pull = channel.unary_stream(
            method_path("Pull"), request_serializer=ps_pb2.PullRequest.SerializeToString
        )
        push_pull = channel.stream_stream(method_path("PushPull"))
        self.push_pull_paths: Dict[str, WirePath] = {
            SHARED_MEMORY: SharedMemoryPath(
                channel.unary_unary(method_path("PushPullShared")), regions, endpoint
            ),
            ONE_MESSAGE: OneMessagePath(
                channel.unary_unary(method_path("PushPullOne")), answer_streams=False
            ),
            STREAM: StreamPath(push_pull, chunk_bytes),
            DURING_BACKWARD: DuringBackwardPath(push_pull, chunk_bytes),
        }
        self.prefetch_paths: Dict[str, WirePath] = {
            ONE_MESSAGE: OneMessagePath(
                channel.unary_stream(method_path("PrefetchOne")), answer_streams=True
            ),
            STREAM: StreamPath(channel.stream_stream(method_path("Prefetch")), chunk_bytes),
        }

    def close(self) -> None:
        """Close the channel; calls still running on it end CANCELLED."""
        self.channel.close()
