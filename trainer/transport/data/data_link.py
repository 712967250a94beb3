"""DataLink: this trainer's data connections to one pserver, and the calls that go over them.

One :class:`~.data_channel.DataChannel` per slot (one per lane for push-pulls and pulls, one more for
prefetches, which a feed thread makes while a step pushes), to the process the pserver's calls go to now,
opened with the session that process's Hello gave: a new Hello (a re-sync, a new primary) names a new
session or address, and the connections are opened again (:meth:`DataLink.moved`). On the pserver's host
each connection maps a pair of shared-memory regions (unless ``shared_memory`` is off or the pserver cannot
map them: then bytes go inline, for good). A push-pull large enough for ``push_lanes`` goes as one call per
lane at once, each lane on its own connection and thread; if one fails the others' connections are closed
(their calls end) and the whole push goes again as any failed push does.

Failures are :class:`~.data_channel.DataCallError` (a ``grpc.RpcError``): the transport reads them as it
reads gRPC's.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from concurrent import futures
from dataclasses import replace
from typing import Dict, List, Optional, Sequence, Tuple

import grpc
import numpy as np
import torch

from psproto.dataplane.access import client_context, server_name
from psproto.dataplane.frames import (
    COUNTED,
    DROPPED,
    HEARTBEAT,
    PREFETCH,
    PULL,
    PUSH_PULL,
    SHARED,
    ConnectionHello,
    RequestHeader,
)
from psproto.security import Security

from ..wire_paths import DecodeInto, Named
from .data_channel import DataCallError, DataChannel
from .payloads import PserverPayloads, Push
from .started import StartedPushPull

log = logging.getLogger(__name__)


class DataLink:
    """The data connections to pserver ``endpoint`` (see the module doc).

    ``payloads``: its layouts; ``lanes``: ``push_lanes``; ``lane_bytes``: the push payload from which a
    push-pull is split across them; ``trainer_id`` and ``layout_digest`` go in every connection's hello.
    """

    def __init__(
        self,
        endpoint: str,
        payloads: PserverPayloads,
        security: Security,
        trainer_id: int,
        layout_digest: str,
        shared_memory: bool,
        lanes: int,
        lane_bytes: int,
        connect_timeout: float,
    ):
        self.endpoint = endpoint
        self.payloads = payloads
        self._token = security.token or ""
        self._context = client_context(security)
        self._security = security
        self._trainer_id = trainer_id
        self._digest = layout_digest
        self._shared_memory = shared_memory
        self._lanes = lanes
        self._lane_bytes = lane_bytes
        self._connect_timeout = connect_timeout
        self._lock = threading.Lock()
        self._target: Optional[Tuple[str, int, str]] = None  # (host, data port, session)
        self._channels: Dict[int, DataChannel] = {}  # by slot
        self._busy: Dict[int, threading.Lock] = {}  # one call at a time per slot
        self._attempts = itertools.count(1)
        self._pool: Optional[futures.ThreadPoolExecutor] = None

    @property
    def available(self) -> bool:
        """Whether the process calls go to has a data port (a Hello answered with one)."""
        return self._target is not None and self._target[1] > 0

    @property
    def connections(self) -> int:
        """Connections open now (one per lane used)."""
        with self._lock:
            return len(self._channels)

    def moved(self, address: str, data_port: int, session: str) -> None:
        """Calls go to ``address`` (its ``data_port``) in ``session`` now: connections elsewhere are
        closed."""
        target = (address.rpartition(":")[0].strip("[]"), data_port, session)
        with self._lock:
            if target == self._target:
                return
            self._target = target
            old, self._channels = self._channels, {}
        for channel in old.values():
            channel.close()

    def _channel(self, slot: int) -> DataChannel:
        with self._lock:
            channel = self._channels.get(slot)
            target = self._target
        if channel is not None:
            return channel
        if target is None or not target[1]:
            raise DataCallError(grpc.StatusCode.UNAVAILABLE, f"{self.endpoint} named no data port")
        host, port, session = target
        hello = ConnectionHello(
            self._trainer_id, slot, max(self._lanes, 1), self._token, session, self._digest
        )
        channel = DataChannel(
            (host, port), hello, self._context, server_name(self._security, host), self._connect_timeout
        )
        if self._shared_memory:
            try:
                channel.map_regions(1 << 20, 1 << 20, self._connect_timeout)
            except DataCallError as e:
                if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                    channel.close()
                    raise
                log.info(
                    "trainer %d: %s cannot map this process's shared memory (%s); its bytes go inline",
                    self._trainer_id,
                    self.endpoint,
                    e.details(),
                )
                self._shared_memory = False
        with self._lock:
            if self._target != target:  # moved meanwhile: this connection is already stale
                channel.close()
                raise DataCallError(grpc.StatusCode.UNAVAILABLE, f"{self.endpoint} moved while connecting")
            self._channels[slot] = channel
        return channel

    def _drop(self, slot: int) -> None:
        with self._lock:
            channel = self._channels.pop(slot, None)
        if channel is not None:
            channel.close()

    def _call(
        self,
        slot: int,
        header: RequestHeader,
        step_trainers: Sequence[int],
        request_bytes: int,
        answer_bytes: int,
        write,
        read,
        timeout: float,
        wait: bool = True,
    ):
        """One call on connection ``slot``: ``write(out)`` puts the payload in ``out`` (the request region
        or the connection's buffer), ``read(payload)`` takes the answer's; (answer header, what ``read``
        gave). Not ``wait``: None, sending nothing, while another call holds the connection."""
        with self._lock:
            busy = self._busy.setdefault(slot, threading.Lock())
        if not busy.acquire(blocking=wait):
            return None
        try:
            while True:
                with self._lock:
                    reused = slot in self._channels
                channel = self._channel(slot)
                try:
                    payload = self._write(channel, request_bytes, answer_bytes, write, timeout)
                    answer, payload = channel.call(_as_sent(header, channel), step_trainers, payload, timeout)
                    return answer, read(payload)
                except DataCallError as e:
                    self._drop(slot)
                    # A connection the pserver closed while it was idle (a newer one of this slot replaced
                    # it, a takeover of this trainer id) broke before the call was read: the call goes again
                    # on a new connection once, whose hello gets the true answer (fenced, down).
                    if not (reused and e.code() == grpc.StatusCode.UNAVAILABLE):
                        raise
        finally:
            busy.release()

    @staticmethod
    def _write(channel: DataChannel, request_bytes: int, answer_bytes: int, write, timeout: float) -> list:
        """``write`` the request's payload where ``channel`` sends it from: its request region (the bytes go
        through the connection's regions; nothing left to send) or its outbox (the buffers to send)."""
        if channel.regions is not None:
            channel.map_regions(request_bytes, answer_bytes, timeout)
            write(np.frombuffer(channel.regions[0].view, np.uint8, request_bytes))
            return []
        out = channel.outbox(request_bytes)
        write(out)
        return [out]

    # -- the calls ----------------------------------------------------------------------------------

    def push_pull(
        self,
        step: int,
        tensors: Sequence[Named],
        position: Tuple[int, int],
        decode_into: DecodeInto,
        step_trainers: Sequence[int],
        dropped: bool,
        timeout: float,
    ) -> Tuple[int, bool, int, int]:
        """One push-pull: (the pserver's lowest step a lane's answer reported, whether it counted, tensor
        bytes sent, tensor bytes received)."""
        whole = self.payloads.plan_push(tensors, 1, 0, dropped)
        lanes = self._lanes if self._lanes > 1 and whole.layout.nbytes >= self._lane_bytes else 1
        attempt = next(self._attempts) if lanes > 1 else 0

        def one(lane: int):
            lane_tensors = self._lane_tensors(tensors, lanes, lane)
            push = whole if lanes == 1 else self.payloads.plan_push(lane_tensors, lanes, lane, dropped)
            request = self._push_request(
                push, lane_tensors, lanes, lane, attempt, step, position, step_trainers, dropped, decode_into
            )
            answer, received = self._call(lane, *request, timeout)
            return answer.step, bool(answer.flags & COUNTED), _tensor_bytes(lane_tensors), received

        results = [one(0)] if lanes == 1 else self._in_lanes(one, lanes)
        return (
            min(r[0] for r in results),
            all(r[1] for r in results),
            sum(r[2] for r in results),
            sum(r[3] for r in results),
        )

    def start_push_pull(
        self,
        step: int,
        tensors: Sequence[Named],
        position: Tuple[int, int],
        decode_into: DecodeInto,
        step_trainers: Sequence[int],
        dropped: bool,
        timeout: float,
    ) -> Optional[StartedPushPull]:
        """:meth:`push_pull`'s request sent on the open connection, its answer read later
        (:meth:`StartedPushPull.finish`); None, having sent nothing, where it takes :meth:`push_pull`:
        no connection open yet, lanes, a call in progress on it, or a connection that broke (closed here).
        """
        whole = self.payloads.plan_push(tensors, 1, 0, dropped)
        if self._lanes > 1 and whole.layout.nbytes >= self._lane_bytes:
            return None
        with self._lock:
            channel = self._channels.get(0)
            busy = self._busy.setdefault(0, threading.Lock())
        if channel is None or not busy.acquire(blocking=False):
            return None
        try:
            header, step_trainers, request_bytes, answer_bytes, write, read = self._push_request(
                whole, tensors, 1, 0, 0, step, position, step_trainers, dropped, decode_into
            )
            payload = self._write(channel, request_bytes, answer_bytes, write, timeout)
            channel.send(_as_sent(header, channel), step_trainers, payload, timeout)
        except DataCallError:
            self._drop(0)
            busy.release()
            return None
        except BaseException:
            busy.release()
            raise
        return StartedPushPull(channel, busy, functools.partial(self._drop, 0), read, _tensor_bytes(tensors))

    def _push_request(
        self, push, tensors, lanes, lane, attempt, step, position, step_trainers, dropped, decode_into
    ) -> tuple:
        """What :meth:`_call` takes for lane ``lane``'s push-pull of ``push`` (its timeout aside)."""
        blocks = self.payloads.lane(lanes, lane)
        header = RequestHeader(
            PUSH_PULL,
            DROPPED if dropped else 0,
            push.grad_dtype,
            lanes,
            lane,
            len(step_trainers),
            step,
            0,
            position[0],
            position[1],
            attempt,
            push.layout.nbytes,
        )
        return (
            header,
            step_trainers,
            push.layout.nbytes,
            self.payloads.answer_bytes(blocks, push.nexts),
            lambda out: self.payloads.write_push(out, push, lanes, lane),
            lambda payload: self.payloads.read_answer(payload, blocks, push.nexts, decode_into),
        )

    def _lane_tensors(self, tensors: Sequence[Named], lanes: int, lane: int) -> List[Named]:
        if lanes == 1:
            return list(tensors)
        names = set(self.payloads.lane(lanes, lane).names)
        return [(n, t) for n, t in tensors if n in names or (lane == 0 and self.payloads.is_table_tensor(n))]

    def _in_lanes(self, one, lanes: int) -> list:
        """``one(lane)`` for every lane at once; the first failure closes every lane's connection."""
        with self._lock:
            if self._pool is None:
                log.info("push-pulls to %s split across lanes: %d connections", self.endpoint, lanes)
                self._pool = futures.ThreadPoolExecutor(
                    lanes, thread_name_prefix=f"data-lanes-{self.endpoint}"
                )
        calls = [self._pool.submit(one, lane) for lane in range(lanes)]
        results, error = [], None
        for call in futures.as_completed(calls):
            try:
                results.append(call.result())
            except Exception as e:  # noqa: BLE001 - the others are ended, then it is raised
                if error is None:
                    error = e
                    for lane in range(lanes):
                        self._drop(lane)
        if error is not None:
            raise error
        return results

    def pull(self, min_step: int, decode_into: DecodeInto, timeout: float) -> Tuple[int, int]:
        """Every block once the pserver's step reaches ``min_step``: (its step, bytes received)."""
        blocks = self.payloads.lane(1, 0)
        header = RequestHeader(PULL, min_step=min_step)
        answer, received = self._call(
            0,
            header,
            (),
            0,
            self.payloads.answer_bytes(blocks, ()),
            lambda out: None,
            lambda payload: self.payloads.read_answer(payload, blocks, (), decode_into),
            timeout,
        )
        return answer.step, received

    def prefetch(
        self, min_step: int, ids: Sequence[Named], timeout: float
    ) -> Tuple[Dict[str, torch.Tensor], int]:
        """Rows of ``ids`` (``[("<table>@ids", ids)]``) once the pserver's step reaches ``min_step``:
        ({"<table>@rows": rows}, bytes received)."""
        push: Push = self.payloads.plan_prefetch(ids)
        header = RequestHeader(PREFETCH, min_step=min_step, payload_bytes=push.layout.nbytes)
        rows = self.payloads.new_rows(push.nexts)
        _, received = self._call(
            max(self._lanes, 1),  # the prefetch slot: a feed thread's, while a step pushes
            header,
            (),
            push.layout.nbytes,
            self.payloads.answer_bytes(None, push.nexts),
            lambda out: self.payloads.write_prefetch(out, push),
            lambda payload: self.payloads.read_answer(payload, None, push.nexts, rows.__getitem__),
            timeout,
        )
        return rows, received

    def heartbeat(self, timeout: float) -> Optional[Tuple[int, int]]:
        """Tell the pserver this trainer lives, on the push-pulls' connection (opened if it is not): (the
        pserver's step, its incarnation), as gRPC's Heartbeat answers; None, sending nothing, while a call
        is in flight on that connection (the pserver counts it as a sign of life until it answers).

        A tenth of a gRPC call's CPU on the pserver (a few checks on a connection already open): where a
        thousand trainers wait between their steps, heartbeats were most of what a pserver did."""
        done = self._call(
            0, RequestHeader(HEARTBEAT), (), 0, 0, lambda out: None, self._incarnation, timeout, wait=False
        )
        return None if done is None else (done[0].step, done[1])

    def _incarnation(self, payload: np.ndarray) -> int:
        """A heartbeat's answer: the pserver's incarnation (int64)."""
        if payload.size != 8:
            raise DataCallError(
                grpc.StatusCode.INTERNAL, f"{self.endpoint} answered a heartbeat with {payload.size} bytes"
            )
        return int(payload.view("<i8")[0])

    def close(self) -> None:
        """Close every connection (and the lanes' threads)."""
        with self._lock:
            old, self._channels = self._channels, {}
            pool, self._pool = self._pool, None
        for channel in old.values():
            channel.close()
        if pool is not None:
            pool.shutdown(wait=False)


def _tensor_bytes(tensors: Sequence[Named]) -> int:
    return sum(t.nbytes for _, t in tensors)


def _as_sent(header: RequestHeader, channel: DataChannel) -> RequestHeader:
    """``header`` as sent on ``channel``: flagged SHARED where its payload went into the request region."""
    return replace(header, flags=header.flags | SHARED) if channel.regions is not None else header
