"""The data channel's calls: a trainer's push-pulls, pulls and prefetches, served as the gRPC data calls are.

Each call is a generator the reactor drives (:mod:`.reactor`): it checks the caller (this process
serves its shard, the connection's session is still the trainer id's, a sign of life), reads the
payload (:mod:`.parts`), and hands the parts to the same cores the gRPC data calls use
(:class:`pserver.rpc.service.data_calls.DataCalls`: ``count_push`` counts or applies a whole push, parking
while an async push is past ``max_staleness``; lanes wait in the same ``LanePushes`` until their push is
whole; ``read_answer`` waits for ``min_step`` and reads blocks and rows). The answer goes into the
connection's answer region, or inline. So sessions, fencing, idempotent retries, backup trainers,
replication and roll-backs are the gRPC path's, unchanged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Tuple

import numpy as np

from psproto.dataplane.access import token_matches
from psproto.dataplane.frames import (
    COUNTED,
    DROPPED,
    HEARTBEAT,
    MAP_REGIONS,
    PULL,
    PUSH_PULL,
    SHARED,
    ConnectionHello,
    FrameError,
    unpack_regions,
)
from psproto.shared_memory import map_region

from ..errors import BadRequest, Unauthenticated
from ..rpc.arrival import CallsInProgress
from ..rpc.parking import park
from ..rpc.prologue import CALLS_LOG, CallerChecks, refusal_of
from ..rpc.service.data_calls import DataCalls
from .inbound import InboundConnection, Request
from .parts import Payloads
from .reactor import Answer

log = logging.getLogger(CALLS_LOG)


@dataclass(frozen=True)
class PushHead:
    """What ``DataCalls.count_push`` and the lanes read of a push: the gRPC ``PushHeader``'s fields."""

    trainer_id: int
    step: int
    epoch: int
    batch: int
    session: str
    attempt: int
    lane: int
    lanes: int
    step_trainers: Tuple[int, ...]
    dropped: bool


class ChannelCalls:
    """Serves the data channel's requests over ``data``'s cores (see the module doc).

    ``token``: the job's auth token (None: none); ``in_progress`` counts each call from its checks to its
    answer, as the gRPC path's calls in progress are counted; ``incarnation()``: what a heartbeat answers
    beside the pserver's step, as gRPC's Heartbeat does.
    """

    def __init__(
        self,
        data: DataCalls,
        checks: CallerChecks,
        payloads: Payloads,
        token: Optional[str],
        in_progress: CallsInProgress,
        incarnation: Callable[[], int],
    ):
        self.data = data
        self.incarnation = incarnation
        self.checks = checks
        self.payloads = payloads
        self.token = token
        self.in_progress = in_progress
        self.engine = data.engine

    def check_hello(self, hello: ConnectionHello) -> None:
        """Accept a connection only from the trainer holding its session, with the token, for this plan."""
        if not token_matches(self.token, hello.token):
            raise Unauthenticated(
                "missing or wrong auth token; set PS_AUTH_TOKEN or PS_AUTH_TOKEN_FILE to the job's token"
            )
        self.checks.serving()
        self.checks.trainer(hello.trainer_id)
        self.checks.digest(hello.layout_digest)
        self.checks.sessions.check(hello.trainer_id, hello.session)

    def serve(self, connection: InboundConnection, request: Request) -> Iterator:
        """One request's call (a generator: Parked handles where it waits, then its :class:`Answer`); its
        refusal counted as the gRPC path counts them."""
        try:
            return self._refusals_counted(self._serve(connection, request))
        except Exception as e:  # noqa: BLE001 - counted, then answered by the reactor
            self._count_refusal(e)
            raise

    def _refusals_counted(self, call: Iterator) -> Iterator:
        try:
            yield from call
        except Exception as e:  # noqa: BLE001 - counted, then answered by the reactor
            self._count_refusal(e)
            raise

    def _count_refusal(self, error: BaseException) -> None:
        self.data.counters.refuse(*refusal_of(error))

    def _serve(self, connection: InboundConnection, request: Request) -> Iterator:
        header = request.header
        if header.kind == MAP_REGIONS:
            return self._map_regions(connection, request)
        trainer_id = connection.trainer_id
        self.checks.serving()
        self.checks.sessions.check(trainer_id, connection.hello.session)
        step = self.engine.touch(trainer_id)
        if header.kind == HEARTBEAT:
            return self._heartbeat(trainer_id, step, request)
        payload = self._payload(connection, request)
        incarnation = self.checks.sessions.incarnation(trainer_id)
        if header.kind == PUSH_PULL:
            call = self._push_pull(connection, request, payload)
        elif header.kind == PULL:
            call = self._pull(connection, request)
        else:
            call = self._prefetch(connection, request, payload)
        return self._counted(trainer_id, incarnation, call)

    def _counted(self, trainer_id: int, incarnation: Optional[int], call: Iterator) -> Iterator:
        """``call``, its trainer counted in progress from now until it ends (answered, refused or dropped)."""
        self.in_progress.begin(trainer_id)
        try:
            yield from call
        finally:
            self.in_progress.end(trainer_id, incarnation if incarnation is not None else 0)

    def _payload(self, connection: InboundConnection, request: Request) -> np.ndarray:
        header = request.header
        if not header.flags & SHARED:
            return request.payload
        if connection.regions is None:
            raise BadRequest("a shared call on a connection that mapped no regions")
        region = connection.regions[0]
        if header.payload_bytes > len(region):
            raise BadRequest(f"a shared payload of {header.payload_bytes} bytes in a region of {len(region)}")
        return np.frombuffer(region, np.uint8, header.payload_bytes)

    def _heartbeat(self, trainer_id: int, step: int, request: Request) -> Iterator:
        """A sign of life, as gRPC's Heartbeat (counted alike): a few checks on a connection already open,
        not a gRPC call (a tenth of its CPU), which matters where a thousand trainers wait between steps."""
        if request.header.payload_bytes:
            raise BadRequest("a heartbeat carries no payload")
        self.data.counters.heartbeat(trainer_id)
        yield Answer(step, buffers=[np.array([self.incarnation()], "<i8")])

    def _map_regions(self, connection: InboundConnection, request: Request) -> Iterator:
        try:
            addresses = unpack_regions(bytes(request.payload))
        except FrameError as e:
            raise BadRequest(str(e)) from None
        views = [map_region(a.pid, a.fd, a.name, a.size) for a in addresses]  # SharedMemoryError: refused
        connection.map_regions(*views)
        yield Answer()

    def _head(self, connection: InboundConnection, request: Request) -> PushHead:
        h = request.header
        if h.step < 0:
            raise BadRequest(f"step must be >= 0, got {h.step}")
        if h.epoch < 0 or h.batch < 0:
            raise BadRequest(f"data position must be >= 0, got epoch {h.epoch} batch {h.batch}")
        return PushHead(
            connection.trainer_id,
            h.step,
            h.epoch,
            h.batch,
            connection.hello.session,
            h.attempt,
            h.lane,
            h.lanes,
            tuple(int(t) for t in request.step_trainers),
            bool(h.flags & DROPPED),
        )

    def _push_pull(self, connection: InboundConnection, request: Request, payload: np.ndarray) -> Iterator:
        header = request.header
        head = self._head(connection, request)
        lane = self.payloads.lane(header.lanes, header.lane)
        data = self.data
        parts, nbytes = self.payloads.push(
            payload, header.lanes, header.lane, header.grad_dtype, head.dropped
        )
        shared = bool(header.flags & SHARED)
        if shared:  # refused before anything counts if the answer cannot fit
            self._check_room(connection, lane, parts.answer_ids)
        if shared:
            data.counters.add(shared_pushes=1)
        answer_ids = parts.answer_ids
        if header.lanes > 1:
            data.counters.add(bytes_in=nbytes)
            ticket = data.lane_pushes.add(
                head.trainer_id,
                head.step,
                head.lane,
                head.lanes,
                (parts.dense, parts.sparse),
                {},
                (head.session, head.attempt),
            )
            # Its parts wait for the other lanes in views of its payload, maybe past this call: never reused.
            connection.release_payload(reuse=False)
            counted = yield from data.lane_pushes.settle(ticket, lambda d, s: data.count_push(head, d, s))
        else:
            counted = yield from data.count_push(head, parts.dense, parts.sparse, nbytes)
            if not shared:
                # Counted: the engine copied or merged what it keeps, and the ids asked ahead are all the
                # answer reads of the payload: its buffer is free for the next request while this one
                # waits for its step (a sync step's K parked pushes hold no payload each).
                answer_ids = {name: ids.copy() for name, ids in parts.answer_ids.items()}
                parts = payload = None
                connection.release_payload()
        if not counted and not head.dropped:  # a dropped push (backup trainers) is never counted
            log.info(
                "%s: duplicate push from trainer %d for step %d acknowledged, not counted again",
                data.endpoint,
                head.trainer_id,
                head.step,
            )
        min_step = self.engine.mode.answer_step(head.step)
        flags = COUNTED if counted else 0
        if shared and self.payloads.in_place(lane):
            pserver_step, written = yield from self._answer_in_place(
                connection, head.trainer_id, min_step, answer_ids
            )
            yield Answer(pserver_step, flags, shared_bytes=written)
            return
        pserver_step, tensors = yield from data.read_answer(head.trainer_id, min_step, lane.names, answer_ids)
        yield self._answer(connection, lane, tensors, pserver_step, flags, shared)

    def _pull(self, connection: InboundConnection, request: Request) -> Iterator:
        header = request.header
        if header.min_step < 0:
            raise BadRequest(f"min_step must be >= 0, got {header.min_step}")
        lane = self.payloads.lane(header.lanes, header.lane)
        shared = bool(header.flags & SHARED)
        if shared:
            self._check_room(connection, lane, {})
            if self.payloads.in_place(lane):
                pserver_step, written = yield from self._answer_in_place(
                    connection, connection.trainer_id, header.min_step, {}
                )
                yield Answer(pserver_step, 0, shared_bytes=written)
                return
        pserver_step, tensors = yield from self.data.read_answer(
            connection.trainer_id, header.min_step, lane.names, None
        )
        yield self._answer(connection, lane, tensors, pserver_step, 0, shared)

    def _prefetch(self, connection: InboundConnection, request: Request, payload: np.ndarray) -> Iterator:
        header = request.header
        if header.min_step < 0:
            raise BadRequest(f"min_step must be >= 0, got {header.min_step}")
        ids = self.payloads.prefetch(payload)
        shared = bool(header.flags & SHARED)
        if shared:
            self._check_room(connection, None, ids)
        pserver_step, rows = yield from self.data.read_answer(connection.trainer_id, header.min_step, [], ids)
        self.data.counters.add(bytes_in=sum(i.nbytes for i in ids.values()), prefetches=1)
        yield self._answer(connection, None, rows, pserver_step, 0, shared)

    def _answer_in_place(self, connection: InboundConnection, trainer_id: int, min_step: int, answer_ids):
        """Wait for ``min_step`` as :meth:`DataCalls.read_answer` does, then write the answer in the
        connection's answer region in place (:meth:`Payloads.in_place`); (the pserver's step, the bytes
        written)."""
        yield from park(self.engine.park_for_step(trainer_id, min_step))
        self.checks.acked()
        out = np.frombuffer(connection.regions[1], np.uint8)
        start = self.payloads.lane(1, 0).layout.nbytes
        pserver_step = self.engine.read_flat_into(out[:start])
        end, rows_bytes = self.payloads.lookup_into(out, start, answer_ids)
        self.data.counters.add(bytes_out=self.payloads.dense_bytes + rows_bytes)
        return pserver_step, end

    def _check_room(self, connection: InboundConnection, lane, answer_ids) -> None:
        """Refuse a shared call whose answer (``lane``'s blocks, the rows of ``answer_ids``) would not fit
        its connection's answer region, before it waits, counts or reads anything."""
        need, room = self.payloads.answer_bytes(lane, answer_ids), len(connection.regions[1])
        if need > room:
            raise BadRequest(f"the answer would carry {need:,} bytes, more than the answer region's {room:,}")

    def _answer(self, connection, lane, tensors, pserver_step: int, flags: int, shared: bool) -> Answer:
        n = len(lane.names) if lane is not None else 0
        blocks, rows = tensors[:n], tensors[n:]
        if shared:
            out = np.frombuffer(connection.regions[1], np.uint8)
            written = self.payloads.write(out, lane, blocks, rows)
            return Answer(pserver_step, flags, shared_bytes=written)
        return Answer(pserver_step, flags, buffers=self.payloads.buffers(lane, blocks, rows))
