"""Lanes: the extra connections a large push-pull to one pserver is split across (``push_lanes``).

Between hosts every byte goes through gRPC Python, and one connection moves
less than several do at once (``benchmarks/bench_lanes.py``: two lanes move 1.3x
the bytes of one, unshaped). A push-pull of at least ``lanes`` chunks that goes
by stream is sent as ``lanes`` calls at once, call ``k`` over connection ``k``
(lane 0 is the channel's own), each carrying the gradients of the blocks
:func:`psproto.lane_blocks.lane_of_blocks` deals to it (tables' tensors in lane 0) and
answered with those blocks; the pserver makes the push whole before counting it
(``pserver/rpc/lane_pushes.py``). If one lane fails the others are cancelled, and the
whole push goes again as any failed push does (pushes are idempotent).

Bounds: ``lanes - 1`` more connections and ``lanes`` threads per pserver, opened
at the first push in lanes (never for a pserver reached through shared memory).
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from concurrent import futures
from typing import Callable, Dict, List, Optional, Sequence

from psproto.lane_blocks import lane_of_blocks, split_by_lane

from .connection import Connection
from .wire_paths import STREAM, Named, NamedTensors, Request

log = logging.getLogger(__name__)


def deal_lanes(tensors: Sequence[Named], lane_of: Dict[str, int], lanes: int) -> List[NamedTensors]:
    """``tensors`` per lane: a block's gradient in its block's lane, every other tensor in lane 0."""
    names = [name for name, _ in tensors]
    return [[tensors[i] for i in positions] for positions in split_by_lane(names, lane_of, lanes)]


class Lanes:
    """The lanes of one pserver's channel: ``lanes`` connections, made by ``connect()`` beyond the
    channel's own."""

    def __init__(
        self,
        lanes: int,
        blocks: Dict[str, int],
        chunk_bytes: int,
        connect: Callable[[], Connection],
        endpoint: str = "",
    ):
        self.lanes = lanes
        self.endpoint = endpoint
        self.lane_of = lane_of_blocks(blocks.items(), lanes) if lanes > 1 else {}
        self._chunk_bytes = chunk_bytes
        self._connect = connect
        self._lock = threading.Lock()
        self._attempts = itertools.count(
            1
        )  # each attempt of a push-pull in lanes, rising (the pserver drops late lanes)
        self._connections: List[Connection] = []
        self._pool: Optional[futures.ThreadPoolExecutor] = None

    def split(self, way: str, request_bytes: int) -> bool:
        """Whether a push-pull going ``way`` with ``request_bytes`` of tensors is split across the lanes."""
        return self.lanes > 1 and way == STREAM and request_bytes >= self.lanes * self._chunk_bytes

    @property
    def opened(self) -> int:
        """The connections opened so far beyond the channel's own."""
        with self._lock:
            return len(self._connections)

    def connections(self, first: Connection) -> List[Connection]:
        """Every lane's connection: ``first`` (the channel's), then the others, opened on first use."""
        with self._lock:
            if len(self._connections) < self.lanes - 1:
                log.info("push-pulls to %s split across lanes: %d connections", self.endpoint, self.lanes)
            while len(self._connections) < self.lanes - 1:
                self._connections.append(self._connect())
            return [first, *self._connections]

    def push_pull(
        self,
        tensors: Sequence[Named],
        first: Connection,
        send: Callable[..., object],
        receive: Callable[[object], int],
    ) -> int:
        """One attempt of a push-pull of ``tensors`` split across the lanes (``first``: the channel's
        connection).

        ``send(connection, request, lane=k, lanes=n, attempt=a)`` sends lane ``k``'s part and returns its
        gRPC call; ``receive(call)`` reads its answer: the pserver's step it reflects. Returns the lowest a
        lane's reflects.
        """
        parts = deal_lanes(tensors, self.lane_of, self.lanes)
        requests = [Request(part, sum(t.numel() * t.element_size() for _, t in part)) for part in parts]
        attempt = next(self._attempts)

        def lane(k: int, connection: Connection, started: Callable[[object], None]) -> int:
            call = send(connection, requests[k], lane=k, lanes=self.lanes, attempt=attempt)
            started(call)
            return receive(call)

        return min(self.run([functools.partial(lane, k, c) for k, c in enumerate(self.connections(first))]))

    def run(self, calls: Sequence[Callable[[Callable[[object], None]], object]]) -> List[object]:
        """Run one call per lane at once; their results.

        Each call gets ``started(rpc)`` to hand over its gRPC call once sent:
        when one lane fails, every other lane's call is cancelled (or is, as it
        starts), so no lane waits at the pserver for a partner that will not
        come; the failure that came first is raised once every call ended, and
        the next attempt opens new connections.
        """
        with self._lock:
            if self._pool is None:
                self._pool = futures.ThreadPoolExecutor(
                    max_workers=self.lanes, thread_name_prefix="trainer-lane"
                )
            pool = self._pool
        sent = _Sent()
        running = [pool.submit(call, sent.started) for call in calls]
        done, _ = futures.wait(running, return_when=futures.FIRST_EXCEPTION)
        first = next((f.exception() for f in done if f.exception() is not None), None)
        if first is not None:
            sent.cancel()
        futures.wait(running)
        if first is not None:
            # Fresh connections for the next attempt: a channel that lost its pserver waits out gRPC's
            # reconnect backoff before it takes calls again, and this trainer's Hello went by another.
            self.reset()
            raise first
        return [f.result() for f in running]

    def reset(self) -> None:
        """Close the extra connections (calls go to another process now); the next push in lanes opens new
        ones."""
        with self._lock:
            connections, self._connections = self._connections, []
        for c in connections:
            c.close()

    def close(self) -> None:
        """Close the extra connections and the lanes' threads."""
        self.reset()
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


class _Sent:
    """The gRPC calls of one push-pull's lanes, cancelled together once one lane failed."""

    def __init__(self):
        self._lock = threading.Lock()
        self._calls: list = []
        self._cancelled = False

    def started(self, call) -> None:
        """A lane sent ``call``; cancelled at once if another lane failed already."""
        with self._lock:
            self._calls.append(call)
            cancelled = self._cancelled
        if cancelled:
            call.cancel()

    def cancel(self) -> None:
        """Cancel every lane's call, and any sent from now on."""
        with self._lock:
            self._cancelled = True
            calls = list(self._calls)
        for call in calls:
            call.cancel()
