"""PserverChannel: one pserver of the plan as this trainer reaches it (its calls, its session, its shard's
primary).

Every call to a pserver goes through its channel: Hello and Close (the session every other call carries),
the unary calls (Heartbeat, Restore, Checkpoint, SaveTables, Reduce, Stats) and the transfers (push-pull,
pull, prefetch), each push-pull and prefetch by the way :func:`~trainer.transport.wire_paths.choose_path`
picks (a large push-pull split across :mod:`.lanes`). Every call has a deadline, and every failure is
re-raised as :class:`PserverError` naming the endpoint, the call and what the pserver said. With hot
standby the channel follows its shard's primary (:class:`~trainer.transport.primaries.ShardPrimary`): a
call that finds it gone goes again to the process that leads now.
"""

from __future__ import annotations

import functools
import logging
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Optional, Sequence, Tuple

import grpc
import torch

from psproto import ps_pb2
from psproto.codec import TensorReader, WireError, decode_chunk
from psproto.wire import method_path
from transpiler import DistributeTranspilerConfig

from ..errors import PserverError, PserverUnavailableError
from .connection import Connection
from .contact import Contact
from .lanes import Lanes
from .narrowing import GradientNarrower
from .primaries import ShardPrimary
from .shared_regions import RegionPool
from .status_codes import details, error_of
from .unary_future import start_unary
from .wire_paths import (
    ANSWER_STREAMS,
    STREAM,
    BackwardTensors,
    DecodeInto,
    DtypeAndShape,
    Named,
    Request,
    SharedMemoryRefused,
    choose_path,
)

log = logging.getLogger(__name__)

# How often a waiting trainer says whom it waits for.
WAIT_LOG_INTERVAL = 5.0

# Close failures worth sending Close again for: the pserver died under the call or is coming back
# (UNAVAILABLE, DEADLINE_EXCEEDED), or restarted and no longer knows this trainer's session (ABORTED).
RETRY_CLOSE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED)


@dataclass(frozen=True)
class TrainerIdentity:
    """Who this trainer process is to every pserver: its id, its plan, and this process's incarnation."""

    trainer_id: int
    layout_digest: str
    incarnation: int


class PserverChannel:
    """Every call this trainer makes to pserver ``endpoint`` (see the module doc).

    ``addresses``: the processes of its shard (itself, and its backup under
    hot standby); ``open_channel(address)`` makes a gRPC channel to one.
    """

    def __init__(
        self,
        endpoint: str,
        addresses: Sequence[str],
        identity: TrainerIdentity,
        config: DistributeTranspilerConfig,
        open_channel: Callable[[str], grpc.Channel],
        regions: RegionPool,
        narrower: GradientNarrower,
        blocks: Optional[Dict[str, int]] = None,
    ):
        self.endpoint = endpoint
        self._address = endpoint  # the process calls go to now (hot standby: the shard's primary)
        self._identity = identity
        self._config = config
        self._open_channel = open_channel
        self._regions = regions
        self._narrower = narrower
        # The session every call carries: what the pserver answered this process's latest Hello.
        self._session = ""
        # Whether the pserver maps this process's shared memory: until it refuses (another host).
        self._shared_memory = config.shared_memory
        self._connection = self._connect_to(endpoint)
        # ``blocks``: this pserver's blocks and their bytes, what a push-pull split across lanes is dealt by.
        self.lanes = Lanes(
            config.push_lanes,
            blocks or {},
            config.chunk_bytes,
            lambda: self._connect_to(self._address),
            endpoint,
        )
        self._lead_calls: Dict[str, Tuple[grpc.Channel, Callable]] = {}
        self.primary = ShardPrimary(self, addresses, identity.trainer_id, config.recovery_timeout)
        self.bytes_pushed = 0
        self.bytes_pulled = 0
        self.contact = Contact()  # when the pserver last heard from this trainer (trainer/heartbeat.py)

    # -- connection and session ---------------------------------------------

    def _connect_to(self, address: str) -> Connection:
        return Connection(self._open_channel(address), self._config.chunk_bytes, self._regions, self.endpoint)

    def connect(self, address: str) -> None:
        """Point every later call at the process at ``address`` (the pserver itself, or its backup)."""
        old, self._connection, self._address = self._connection, self._connect_to(address), address
        old.close()
        self.lanes.reset()

    def lead(self, address: str, timeout: float) -> Optional[Tuple[str, int]]:
        """Ask the process at ``address`` whether it leads its shard: (role, epoch), or None if it did not
        answer."""
        call = self._lead_calls.get(address)
        if call is None:
            channel = self._open_channel(address)
            call = self._lead_calls[address] = (
                channel,
                channel.unary_unary(
                    method_path("Lead"),
                    request_serializer=ps_pb2.LeadRequest.SerializeToString,
                    response_deserializer=ps_pb2.LeadReply.FromString,
                ),
            )
        try:
            reply = call[1](ps_pb2.LeadRequest(), timeout=timeout)
        except grpc.RpcError:
            return None
        return reply.role, reply.epoch

    @property
    def session(self) -> str:
        """The session this trainer's calls carry (empty before Hello)."""
        return self._session

    def use_session(self, session: str) -> None:
        """Carry ``session`` from now on: a node's local ranks use the one their leader's Hello opened."""
        self._session = session

    def hello(self, deadline: float, timeout: float, join_at: int = 0) -> ps_pb2.HelloReply:
        """Open this trainer's session at the pserver (with hot standby: its shard's primary); its answer.

        Waits for the pserver until ``deadline`` (monotonic), ``timeout`` s in
        all; ``join_at``: see ``Channels.hello``.
        """
        if not self.primary.replicated:
            return self.hello_here(deadline, join_at, timeout)
        while True:  # None: another call followed the primary meanwhile; say Hello there too
            reply = self.primary.follow(self.primary.generation, deadline, join_at)
            if reply is not None:
                return reply

    def hello_here(
        self, deadline: float, join_at: int = 0, timeout: Optional[float] = None
    ) -> ps_pb2.HelloReply:
        """Hello to the process calls go to now, waiting for it (and for a predecessor's session) until
        ``deadline``.

        ``timeout``: how long the caller waits in all, for the error that says so (default: until
        ``deadline``).
        """
        tid = self._identity.trainer_id
        timeout = max(0.0, deadline - time.monotonic()) if timeout is None else timeout
        request = ps_pb2.HelloRequest(
            trainer_id=tid,
            layout_digest=self._identity.layout_digest,
            incarnation=self._identity.incarnation,
            join_at=join_at,
        )
        next_log, last, id_taken_until = 0.0, "no answer", None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PserverUnavailableError(
                    self.endpoint, f"did not come up within {timeout:g}s (trainer {tid}; last error: {last})"
                )
            if time.monotonic() >= next_log:
                log.info("trainer %d: waiting for %s", tid, self.endpoint)
                next_log = time.monotonic() + WAIT_LOG_INTERVAL
            started = time.monotonic()
            try:
                reply = self._connection.unary["Hello"](
                    request, timeout=min(remaining, WAIT_LOG_INTERVAL), wait_for_ready=True
                )
                log.info("trainer %d: %s is up (step %d)", tid, self.endpoint, reply.start_step)
                self._session = reply.session
                self.contact.noted(started)
                return reply
            except grpc.RpcError as e:
                code = e.code()
                if code == grpc.StatusCode.ALREADY_EXISTS:
                    # Another process holds this id. If it is this trainer's predecessor, killed
                    # moments ago, its session ages out within one alive window; a true duplicate
                    # is still there after it.
                    now = time.monotonic()
                    if id_taken_until is None:
                        id_taken_until = (
                            now + self._config.session_alive_window + self._config.heartbeat_interval
                        )
                    if now >= min(id_taken_until, deadline):
                        raise error_of(self.endpoint, f"refused Hello: {details(e)}", e) from None
                    last = details(e)
                    time.sleep(max(0.0, min(self._config.heartbeat_interval / 4, deadline - now)))
                    continue
                if code == grpc.StatusCode.UNAVAILABLE and self.primary.replicated:
                    # Down, or a replica that does not lead: the caller asks the shard who leads.
                    raise error_of(self.endpoint, f"Hello: {details(e)}", e) from None
                # CANCELLED: a pserver shutting down cancels the calls it holds, a waiting Hello too.
                if code not in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.CANCELLED,
                ):
                    raise error_of(self.endpoint, f"refused Hello: {details(e)}", e) from None
                last = details(e)

    def close(self, deadline: float) -> int:
        """Tell the pserver this trainer is done; the trainers it has left (-1: not told).

        A Close lost to a pserver that died under it (or that is restarting)
        is sent again until ``deadline`` (monotonic): a pserver restarted from
        a checkpoint written before this Close would otherwise wait for this
        trainer, and never finish. A restarted pserver no longer knows this
        trainer's session, so the trainer says Hello to it first.
        """
        tid = self._identity.trainer_id
        while True:
            generation = self.primary.generation
            request = ps_pb2.CloseRequest(trainer_id=tid, session=self._session)
            remaining = deadline - time.monotonic()
            # While retrying, each try waits for the pserver a while (and logs), as Hello does.
            timeout = (
                min(remaining, WAIT_LOG_INTERVAL) if remaining > 0 else min(self._config.rpc_timeout, 30.0)
            )
            try:
                # Hot standby: no waiting for a dead primary to come back (its backup leads): UNAVAILABLE at
                # once.
                ready = remaining > 0 and not self.primary.replicated
                return self._connection.unary["Close"](
                    request, timeout=timeout, wait_for_ready=ready
                ).trainers_left
            except grpc.RpcError as e:
                code, remaining = e.code(), deadline - time.monotonic()
                if not (remaining > 0 and code in RETRY_CLOSE):
                    log.warning("trainer %d: close at %s failed: %s", tid, self.endpoint, details(e))
                    return -1
                log.info(
                    "trainer %d: close at %s failed (%s); sending it again", tid, self.endpoint, details(e)
                )
                try:
                    if code == grpc.StatusCode.UNAVAILABLE and self.primary.replicated:
                        self.primary.follow(
                            generation, deadline
                        )  # hot standby: the other process may lead now
                    elif code == grpc.StatusCode.ABORTED:  # a restarted pserver: a session first
                        self.hello_here(deadline)
                except PserverError as failed:
                    log.warning("trainer %d: close at %s failed: %s", tid, self.endpoint, failed)
                    return -1

    # -- transfers ----------------------------------------------------------

    def push_pull(
        self,
        step: int,
        tensors: Iterable[Named],
        dtype_and_shape: DtypeAndShape,
        decode_into: DecodeInto,
        position: Tuple[int, int] = (0, 0),
        during_backward: bool = False,
        answer_bytes: Optional[int] = None,
        step_trainers: Sequence[int] = (),
        dropped: bool = False,
    ) -> int:
        """Send one step's gradients and receive the pserver's blocks in the same call.

        ``tensors`` are the gradients of the blocks (and table rows) this pserver owns, sent in
        ``grad_wire_dtype`` if one is set; the answer's tensors land in ``decode_into(name)``, checked by
        ``dtype_and_shape``. A sync pserver answers once every live trainer pushed the step. ``position``
        is the trainer's (epoch, batch) after this step, kept in checkpoints. ``during_backward``:
        ``tensors`` is an iterator that may wait for each tensor (blocks pushed while backward still
        produces the others); the call ends when it does. ``answer_bytes``: the tensor bytes of the answer
        (its blocks and rows asked ahead), when known. ``step_trainers`` / ``dropped``: backup trainers'
        verdict on the step (:meth:`claim`). Returns the pserver's step (updates applied) of the parameters
        received.
        """
        if during_backward:
            request = Request(
                BackwardTensors(tensors, functools.partial(self._narrower.narrow_stream, self.endpoint))
            )
        else:
            narrowed = self._narrower.narrow(self.endpoint, list(tensors))
            request = Request(narrowed, sum(t.numel() * t.element_size() for _, t in narrowed), answer_bytes)
        header = functools.partial(
            ps_pb2.PushHeader,
            trainer_id=self._identity.trainer_id,
            step=step,
            layout_digest=self._identity.layout_digest,
            epoch=position[0],
            batch=position[1],
            step_trainers=list(step_trainers),
            dropped=dropped,
        )
        what = f"step {step} of trainer {self._identity.trainer_id} (push and pull)"
        pserver_step = self.primary.run(
            functools.partial(
                self._push_pull_once, header, request, during_backward, what, dtype_and_shape, decode_into
            )
        )
        self.bytes_pushed += request.tensors.nbytes if during_backward else request.nbytes
        return pserver_step

    def _push_pull_once(
        self,
        header: Callable,
        request: Request,
        during_backward: bool,
        what: str,
        dtype_and_shape: DtypeAndShape,
        decode_into: DecodeInto,
    ) -> int:
        """One attempt of a push-pull, to the process calls go to now (with its session)."""
        way = choose_path(request.nbytes, request.answer_bytes, self._shared_memory, during_backward)
        if self.lanes.split(way, request.nbytes):
            return self._push_pull_lanes(header, request, what, dtype_and_shape, decode_into)
        try:
            return self._attempt(
                self._connection.push_pull_paths[way], header, request, what, dtype_and_shape, decode_into
            )[0]
        except SharedMemoryRefused as refused:
            if refused.for_good:
                log.info(
                    "trainer %d: %s cannot map this process's shared memory (%s); pushes to it go through "
                    "gRPC",
                    self._identity.trainer_id,
                    self.endpoint,
                    refused,
                )
                self._shared_memory = False
            way = choose_path(request.nbytes, request.answer_bytes, False, during_backward)
            return self._attempt(
                self._connection.push_pull_paths[way], header, request, what, dtype_and_shape, decode_into
            )[0]

    def _push_pull_lanes(
        self,
        header: Callable,
        request: Request,
        what: str,
        dtype_and_shape: DtypeAndShape,
        decode_into: DecodeInto,
    ) -> int:
        """One attempt of a push-pull split across the lanes (:mod:`.lanes`); the lowest pserver step a lane's
        answer had."""

        def send(connection: Connection, part: Request, **lane: int):
            return connection.push_pull_paths[STREAM].send(
                header(session=self._session, **lane), part, self._wait_timeout
            )

        return self.lanes.push_pull(
            request.tensors,
            self._connection,
            send,
            lambda call: self._receive(what, lambda: call, dtype_and_shape, decode_into)[0],
        )

    def pull(
        self, names: Sequence[str], min_step: int, dtype_and_shape: DtypeAndShape, decode_into: DecodeInto
    ) -> int:
        """Receive blocks ``names`` into ``decode_into(name)`` once the pserver's step reaches ``min_step``.

        Returns the pserver's step (updates applied) of the parameters received.
        """
        request = functools.partial(
            ps_pb2.PullRequest,
            trainer_id=self._identity.trainer_id,
            min_step=min_step,
            names=list(names),
            layout_digest=self._identity.layout_digest,
        )
        what = f"pull after {min_step} updates by trainer {self._identity.trainer_id}"
        return self.primary.run(
            functools.partial(self._pull_once, request, what, dtype_and_shape, decode_into)
        )

    def _pull_once(
        self, request: Callable, what: str, dtype_and_shape: DtypeAndShape, decode_into: DecodeInto
    ) -> int:
        call = functools.partial(
            self._connection.pull, request(session=self._session), timeout=self._wait_timeout
        )
        return self._receive(what, call, dtype_and_shape, decode_into)[0]

    def prefetch(
        self, min_step: int, ids: Sequence[Named], dtype_and_shape: DtypeAndShape
    ) -> Dict[str, torch.Tensor]:
        """Send ``ids`` (``[("<table>@ids", ids)]``) and receive their rows, checked by ``dtype_and_shape``.

        Sync pservers answer once their step reaches ``min_step``.
        Returns ``{"<table>@rows": rows}``.
        """
        ids = list(ids)
        request = Request(ids, sum(t.numel() * t.element_size() for _, t in ids), ANSWER_STREAMS)
        header = functools.partial(
            ps_pb2.PrefetchHeader,
            trainer_id=self._identity.trainer_id,
            min_step=min_step,
            layout_digest=self._identity.layout_digest,
        )
        what = f"prefetch after {min_step} updates by trainer {self._identity.trainer_id}"
        return self.primary.run(
            functools.partial(self._prefetch_once, header, request, what, dtype_and_shape)
        )

    def _prefetch_once(
        self, header: Callable, request: Request, what: str, dtype_and_shape: DtypeAndShape
    ) -> Dict[str, torch.Tensor]:
        path = self._connection.prefetch_paths[
            choose_path(request.nbytes, request.answer_bytes, False, False)
        ]
        return self._attempt(path, header, request, what, dtype_and_shape, None)[1]

    @property
    def _wait_timeout(self) -> float:
        """The deadline of a call a sync barrier may hold."""
        return self._config.barrier_timeout + self._config.rpc_timeout

    def _attempt(
        self,
        path,
        header: Callable,
        request: Request,
        what: str,
        dtype_and_shape: DtypeAndShape,
        decode_into: Optional[DecodeInto],
    ) -> Tuple[int, Dict[str, torch.Tensor]]:
        """Send ``request`` by ``path`` with a header carrying the current session; read its answer."""
        call = functools.partial(path.send, header(session=self._session), request, self._wait_timeout)
        return self._receive(
            what, call, dtype_and_shape, decode_into, not isinstance(request.tensors, BackwardTensors)
        )

    def _receive(
        self,
        what: str,
        call: Callable[[], Iterable[bytes]],
        dtype_and_shape: DtypeAndShape,
        decode_into: Optional[DecodeInto],
        sent_at_once: bool = True,
    ) -> Tuple[int, Dict[str, torch.Tensor]]:
        """Run ``call`` (its answer: PullChunks) and rebuild the answer's tensors: (updates, tensors).

        The pserver notes the call as a sign of life on arrival and holds a parked one (:mod:`.contact`):
        it is contact while in flight; one not ``sent_at_once`` (its tensors stream during backward) once
        it went through.
        """
        reader = TensorReader(dtype_and_shape, decode_into)
        pserver_step = None
        try:
            with self.contact.call(from_start=sent_at_once):
                for data in call():
                    header, pieces = decode_chunk(data, ps_pb2.PullHeader)
                    if header is not None:
                        pserver_step = header.step
                    for piece in pieces:
                        reader.add(piece)
            tensors = reader.finish()
        except grpc.RpcError as e:
            raise error_of(self.endpoint, f"{what} failed: {details(e)}", e) from None
        except WireError as e:
            raise PserverError(self.endpoint, f"{what}: answer is malformed: {e}") from None
        if pserver_step is None:
            raise PserverError(self.endpoint, f"{what}: answer carried no header")
        self.bytes_pulled += reader.nbytes
        return pserver_step, tensors

    # -- unary calls ----------------------------------------------------------

    def _unary(self, method: str, request: Callable, what: str, timeout: float):
        """Call ``method`` with ``request(session=...)`` (built by each attempt: a new session after a
        failover)."""
        return self.primary.run(functools.partial(self._unary_once, method, request, what, timeout))

    def _unary_once(self, method: str, request: Callable, what: str, timeout: float):
        try:  # Heartbeat, SaveTables, Restore, Checkpoint, Reduce: all touch on arrival
            with self.contact.call():
                return self._connection.unary[method](request(session=self._session), timeout=timeout)
        except grpc.RpcError as e:
            raise error_of(self.endpoint, f"{what} failed: {details(e)}", e) from None

    def heartbeat(self, timeout: float) -> ps_pb2.HeartbeatReply:
        """Tell the pserver this trainer lives; its answer carries its step and incarnation."""
        tid = self._identity.trainer_id
        return self._unary(
            "Heartbeat",
            functools.partial(ps_pb2.HeartbeatRequest, trainer_id=tid),
            f"heartbeat of trainer {tid}",
            timeout,
        )

    def save_tables(self, directory: str) -> ps_pb2.SaveTablesReply:
        """Ask the pserver to write its table shards under ``directory`` (its file system)."""
        request = functools.partial(
            ps_pb2.SaveTablesRequest,
            trainer_id=self._identity.trainer_id,
            directory=directory,
            layout_digest=self._identity.layout_digest,
        )
        return self._unary("SaveTables", request, f"saving tables to {directory!r}", self._config.rpc_timeout)

    def restore(self, step: int, token: str) -> ps_pb2.RestoreReply:
        """Ask the pserver to roll back to its checkpoint at ``step`` (once per ``token``)."""
        tid = self._identity.trainer_id
        request = functools.partial(
            ps_pb2.RestoreRequest,
            trainer_id=tid,
            checkpoint_step=step,
            token=token,
            layout_digest=self._identity.layout_digest,
        )
        return self._unary(
            "Restore", request, f"roll-back to step {step} asked by trainer {tid}", self._config.rpc_timeout
        )

    def checkpoint(self) -> ps_pb2.CheckpointReply:
        """Ask the pserver to write its part of a checkpoint now."""
        tid = self._identity.trainer_id
        request = functools.partial(
            ps_pb2.CheckpointRequest, trainer_id=tid, layout_digest=self._identity.layout_digest
        )
        return self._unary(
            "Checkpoint", request, f"checkpoint asked by trainer {tid}", self._config.rpc_timeout
        )

    def reduce(
        self, key: str, round_: int, op: str, values: Sequence[Tuple[str, Sequence[int], Sequence[float]]]
    ) -> ps_pb2.ReduceReply:
        """Combine ``values`` ([(name, shape, float64 data)]) with every live trainer's for ``(key, round_)``
        (answered once all are in, or refused after the pserver's barrier_timeout naming the missing ones)."""
        tid = self._identity.trainer_id
        request = functools.partial(
            ps_pb2.ReduceRequest,
            trainer_id=tid,
            layout_digest=self._identity.layout_digest,
            key=key,
            round=round_,
            op=op,
            values=[ps_pb2.ReduceValue(name=n, shape=shape, data=data) for n, shape, data in values],
        )
        return self._unary(
            "Reduce", request, f"round {round_} of reduction {key!r} by trainer {tid}", self._wait_timeout
        )

    def claim(self, step: int) -> ps_pb2.ClaimReply:
        """Backup trainers: whether this trainer's push counts in ``step``, and the step's trainers (first
        pserver)."""
        request = functools.partial(
            ps_pb2.ClaimRequest,
            trainer_id=self._identity.trainer_id,
            step=step,
            layout_digest=self._identity.layout_digest,
        )
        return self._unary("Claim", request, f"claim of step {step}", self._wait_timeout)

    def stats(self, timeout: float) -> futures.Future:
        """The pserver's counters (``StatsReply``), asked of the process calls go to now: a future.

        No session and no following of the shard's primary (an observer must
        not move the trainer's calls); see :func:`.unary_future.start_unary`.
        """
        return start_unary(
            self._connection.unary["Stats"], ps_pb2.StatsRequest(), self.endpoint, "Stats", timeout
        )

    def shutdown(self) -> None:
        """Close the gRPC channels (without telling the pserver); calls still running end CANCELLED."""
        self._connection.close()
        self.lanes.close()
        for channel, _ in self._lead_calls.values():
            channel.close()
