"""Arrival: a trainer's call is a sign of life when it reaches the pserver, not when a handler thread takes it.

Every trainer call names its trainer in its metadata
(:data:`psproto.wire.TRAINER_METADATA`). The server's event loop hears of
each call as it arrives and notes the trainer at once (the engine's
lock-free ``touch``), before the call waits for one of the pool's threads.
Under a burst (a thousand trainers' pushes of a step queued behind a few
handler threads) a trainer whose push is queued is then not silent, and its
heartbeats, queued behind the same pushes, are not what keeps it in.

Only liveness rides on it: the session, the layout digest and every other
check stay with the call itself. A value that is no trainer id of the job is
ignored.
"""
from __future__ import annotations

from typing import Callable

import grpc

from psproto.wire import TRAINER_METADATA


def trainer_of(metadata, trainers: int):
    """The trainer id ``metadata`` names under TRAINER_METADATA, if it is one of ``trainers``; else None."""
    for key, value in metadata or ():
        if key == TRAINER_METADATA:
            try:
                trainer_id = int(value)
            except (TypeError, ValueError):
                return None
            return trainer_id if 0 <= trainer_id < trainers else None
    return None


class ArrivalInterceptor(grpc.aio.ServerInterceptor):
    """Notes each arriving trainer call with ``touch(trainer_id)`` (after the token check), then serves it."""

    def __init__(self, touch: Callable[[int], object], trainers: int):
        self._touch = touch
        self._trainers = trainers

    async def intercept_service(self, continuation, handler_call_details):
        """Touch the trainer the call names, if any; the call goes on unchanged."""
        trainer_id = trainer_of(handler_call_details.invocation_metadata, self._trainers)
        if trainer_id is not None:
            self._touch(trainer_id)
        return await continuation(handler_call_details)
