"""Communicator: a trainer's channels to the pservers, and push / pull over them (Hello and Close: .sessions).

One channel per pserver; transfers to different pservers run in parallel on
a small thread pool (gRPC releases the GIL while bytes move). Every call has
a deadline, and every failure is re-raised as :class:`PserverError` naming
the endpoint, the step and what the pserver said.
"""
from __future__ import annotations

import functools
import logging
import secrets
from concurrent import futures
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import grpc
import torch

from psproto import ps_pb2, ps_pb2_grpc
from psproto.codec import ONE_MESSAGE_BYTES, TensorReader, WireError, decode_chunk, encode_chunks, encode_into
from psproto.wire import method_path, one_message
from psproto.options import channel_options
from transpiler import TrainerProgram
from psproto.security import Security

from ..errors import PserverError
from ..narrowing import GradientNarrower
from ..primaries import Primaries
from ..shared_regions import RegionPool
from .sessions import SessionCalls
from .status import details, error_of

log = logging.getLogger(__name__)


def _call(one: Callable, streamed: Callable, header, tensors: Sequence[Tuple[str, torch.Tensor]],
          chunk_bytes: int, timeout: float):
    """Send ``header`` and ``tensors`` by ``one`` (a unary call) or, if big, ``streamed`` in chunks.

    A request of at most :data:`ONE_MESSAGE_BYTES` of tensor data is encoded
    as a single message: in gRPC Python a client-streamed call costs a thread
    per call, which dominates small pushes and prefetches.
    """
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    if total <= ONE_MESSAGE_BYTES:
        return one(one_message(header, tensors, total), timeout=timeout)
    return streamed(encode_chunks(header, tensors, chunk_bytes), timeout=timeout)


def results_of(calls: Dict[str, futures.Future]) -> Dict[str, object]:
    """Every call's result by endpoint, once all ended; the first failure is re-raised after the last ends."""
    results, error = {}, None
    for ep, fut in calls.items():
        try:
            results[ep] = fut.result()
        except Exception as e:  # surface after all finish, so none is left running
            error = error or e
    if error is not None:
        raise error
    return results


class Communicator(SessionCalls):
    """Push gradients to and pull parameters from every pserver of a trainer program."""

    def __init__(self, program: TrainerProgram, security: Optional[Security] = None):
        self.program = program
        self.trainer_id = program.trainer_id
        self.digest = program.layout_digest
        # This process's identity at Hello; each pserver answers with the session every call carries.
        self.incarnation = secrets.randbits(63) or 1
        self.sessions: Dict[str, str] = {}
        cfg = program.config
        self.alive_window = cfg.session_alive_window
        self.heartbeat_interval = cfg.heartbeat_interval
        self.chunk_bytes = cfg.chunk_bytes
        self.rpc_timeout = cfg.rpc_timeout
        self.barrier_timeout = cfg.barrier_timeout
        # Hot standby: a primary cut off by the network is noticed by keepalive pings, not TCP's timeout.
        self._options = channel_options(cfg.chunk_bytes, fast_keepalive=program.replicated)
        self._security = security if security is not None else Security.from_env()
        self._channels: Dict[str, grpc.Channel] = {}
        self._stubs: Dict[str, ps_pb2_grpc.ParameterServerStub] = {}
        self._push_pull_calls, self._pull_calls, self._prefetch_calls = {}, {}, {}
        self._push_pull_one_calls, self._prefetch_one_calls, self._push_pull_shared_calls = {}, {}, {}
        self._lead_calls = {}
        for ep in program.pservers:
            self._connect(ep, ep)
        # Hot standby: each pserver's processes, and which one leads (trainer/primaries.py).
        self._hello_replies: Dict[str, ps_pb2.HelloReply] = {}
        self.primaries = Primaries(program.replica_groups, self._connect, self._lead, self._hello_primary,
                                   self.trainer_id, cfg.recovery_timeout)
        self.shared = {ep: cfg.shared_memory for ep in program.pservers}
        self._regions = RegionPool()
        # Two calls per pserver may run at once: a step sent in the background
        # (async pipeline) and the next step's prefetch.
        self._pool = futures.ThreadPoolExecutor(max_workers=2 * len(program.pservers),
                                                thread_name_prefix="trainer-comm")
        self.bytes_pushed = 0
        self.bytes_pulled = 0
        self.narrower = GradientNarrower(cfg.grad_wire_dtype)

    # -- connection ---------------------------------------------------------

    def _connect(self, endpoint: str, address: str) -> None:
        """Point every call to pserver ``endpoint`` at the process at ``address`` (itself, or its replica)."""
        old = self._channels.get(endpoint)
        ch = self._channels[endpoint] = self._security.channel(address, self._options)
        self._stubs[endpoint] = ps_pb2_grpc.ParameterServerStub(ch)
        # PushPull, Pull and Prefetch carry tensor bytes: encoded and decoded by
        # psproto.codec (the same wire format, fewer copies), so the channel passes raw bytes.
        self._push_pull_calls[endpoint] = ch.stream_stream(method_path("PushPull"))
        self._pull_calls[endpoint] = ch.unary_stream(method_path("Pull"),
                                                     request_serializer=ps_pb2.PullRequest.SerializeToString)
        self._prefetch_calls[endpoint] = ch.stream_stream(method_path("Prefetch"))
        # Requests that fit in one message go unary: no request-streaming thread per call; a push
        # whose answer fits one message too goes unary both ways (PushPullOne).
        self._push_pull_one_calls[endpoint] = ch.unary_unary(method_path("PushPullOne"))
        self._prefetch_one_calls[endpoint] = ch.unary_stream(method_path("PrefetchOne"))
        # A pserver that maps this process's regions gets pushes and answers through shared memory
        # (psproto.shared_memory); one that cannot (another host) is sent bytes from its first refusal on.
        self._push_pull_shared_calls[endpoint] = ch.unary_unary(method_path("PushPullShared"))
        if old is not None:
            old.close()

    # -- transfers ----------------------------------------------------------

    def push_pull(self, endpoint: str, step: int, tensors: Iterable[Tuple[str, torch.Tensor]],
                  expect: Callable, dest: Callable[[str], torch.Tensor],
                  position: Tuple[int, int] = (0, 0), streamed: bool = False,
                  answer_bytes: Optional[int] = None) -> int:
        """Send one step's gradients to ``endpoint`` and receive its blocks in the same call.

        ``tensors`` are the gradients of the blocks (and table rows) this
        pserver owns, sent in ``grad_wire_dtype`` if one is set; its blocks
        land in ``dest(name)``, checked by ``expect``.
        A sync pserver answers once every live trainer pushed the step.
        ``position`` is the trainer's (epoch, batch) after this step, kept in checkpoints.
        ``streamed``: ``tensors`` is an iterator that may wait for each tensor
        (blocks pushed while backward still produces the others); the call
        streams them as they come and ends when the iterator does.
        ``answer_bytes``: the tensor bytes the answer carries (its blocks and
        asked rows), when known: a request and an answer that each fit in one
        message go as one message each way (PushPullOne), else the call streams.
        Returns the updates the pserver had applied to the parameters received.
        """
        timeout = self.barrier_timeout + self.rpc_timeout
        sent = [0]
        if streamed:
            # Kept as they stream: a push resent to a shard's new primary sends them again.
            kept: List[Tuple[str, torch.Tensor]] = []
            source = iter(tensors)

            def replayed():
                yield from list(kept)
                for item in source:
                    kept.append(item)
                    yield item
        else:
            tensors = self.narrower.narrow(endpoint, list(tensors))
            sent[0] = sum(t.numel() * t.element_size() for _, t in tensors)

        def attempt():
            header = ps_pb2.PushHeader(trainer_id=self.trainer_id, step=step, layout_digest=self.digest,
                                       epoch=position[0], batch=position[1],
                                       session=self.sessions.get(endpoint, ""))
            if streamed:
                sent[0] = 0

                def narrowed():
                    for name, t in self.narrower.narrow_stream(endpoint, replayed()):
                        sent[0] += t.numel() * t.element_size()
                        yield name, t
                call = lambda: self._push_pull_calls[endpoint](  # noqa: E731
                    encode_chunks(header, narrowed(), self.chunk_bytes), timeout=timeout)
            elif sent[0] <= ONE_MESSAGE_BYTES and answer_bytes is not None and answer_bytes <= ONE_MESSAGE_BYTES:
                message = one_message(header, tensors, sent[0])
                call = lambda: (self._push_pull_one_calls[endpoint](message, timeout=timeout),)  # noqa: E731
            else:
                call = lambda: self._push_pull_calls[endpoint](  # noqa: E731
                    encode_chunks(header, tensors, self.chunk_bytes), timeout=timeout)
            if not streamed and self.shared[endpoint] and answer_bytes is not None:
                call = functools.partial(self._push_pull_shared, endpoint, header, tensors, sent[0], answer_bytes,
                                         timeout, call)
            return self._receive(endpoint, f"step {step} of trainer {self.trainer_id} (push and pull)",
                                 call, expect, dest)[0]

        updates = self.primaries.run(endpoint, attempt)
        self.bytes_pushed += sent[0]
        return updates

    def _push_pull_shared(self, endpoint: str, header, tensors: Sequence[Tuple[str, torch.Tensor]], nbytes: int,
                          answer_bytes: int, timeout: float, by_grpc: Callable) -> Iterator:
        """A push and its answer through shared memory (PushPullShared): yields the answer's message.

        ``nbytes`` and ``answer_bytes``: the tensor bytes each way. A pserver
        that cannot map this process's regions is sent this push, and every
        later one, by ``by_grpc`` instead.
        """
        request_bytes = nbytes + 256 + sum(len(name) + 64 for name, _ in tensors)  # tensors and their pieces' meta
        pair = self._regions.take(endpoint, request_bytes, answer_bytes + 4096)
        done = False
        try:
            length = encode_into(pair.request.view, header, tensors)
            if length < 0:  # more meta than guessed: this once through gRPC
                done = True
                yield from by_grpc()
                return
            push = ps_pb2.SharedPush(request=pair.request.address(ps_pb2.SharedRegion), request_bytes=length,
                                     answer=pair.answer.address(ps_pb2.SharedRegion))
            try:
                reply = ps_pb2.SharedAnswer.FromString(
                    self._push_pull_shared_calls[endpoint](push.SerializeToString(), timeout=timeout))
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                # Refused before the push counted: nothing was applied, so it goes again by gRPC.
                log.info("trainer %d: %s cannot map this process's shared memory (%s); pushes to it go through "
                         "gRPC", self.trainer_id, endpoint, details(e))
                self.shared[endpoint] = False
                done = True
                yield from by_grpc()
                return
            yield reply.inline if reply.inline else pair.answer.view[:reply.answer_bytes]
            done = True
        finally:
            # A call that failed may still be answered into its regions: they are not reused.
            self._regions.give_back(endpoint, pair, reusable=done)

    def pull(self, endpoint: str, names: Sequence[str], min_updates: int,
             expect: Callable, dest: Callable[[str], torch.Tensor]) -> int:
        """Receive blocks ``names`` into ``dest(name)`` once ``min_updates`` is reached.

        Returns the updates the pserver had applied to the parameters received.
        """
        def attempt():
            request = ps_pb2.PullRequest(trainer_id=self.trainer_id, min_updates=min_updates,
                                         names=list(names), layout_digest=self.digest,
                                         session=self.sessions.get(endpoint, ""))
            return self._receive(
                endpoint, f"pull after {min_updates} updates by trainer {self.trainer_id}",
                lambda: self._pull_calls[endpoint](request, timeout=self.barrier_timeout + self.rpc_timeout),
                expect, dest)[0]
        return self.primaries.run(endpoint, attempt)

    def prefetch(self, endpoint: str, min_updates: int,
                 ids: Sequence[Tuple[str, torch.Tensor]], expect: Callable) -> Dict[str, torch.Tensor]:
        """Send ``ids`` (``[("<table>@ids", ids)]``) and receive their rows, checked by ``expect``.

        Sync pservers answer once ``min_updates`` updates are applied.
        Returns ``{"<table>@rows": rows}``.
        """
        def attempt():
            header = ps_pb2.PrefetchHeader(trainer_id=self.trainer_id, min_updates=min_updates,
                                           layout_digest=self.digest, session=self.sessions.get(endpoint, ""))
            return self._receive(
                endpoint, f"prefetch after {min_updates} updates by trainer {self.trainer_id}",
                lambda: _call(self._prefetch_one_calls[endpoint], self._prefetch_calls[endpoint], header, ids,
                              self.chunk_bytes, timeout=self.barrier_timeout + self.rpc_timeout),
                expect, None)[1]
        return self.primaries.run(endpoint, attempt)

    def _receive(self, endpoint: str, what: str, call: Callable, expect: Callable,
                 dest: Optional[Callable]) -> Tuple[int, Dict[str, torch.Tensor]]:
        """Run ``call`` (a streamed PullChunk answer) and rebuild its tensors: (updates, tensors)."""
        reader = TensorReader(expect, dest)
        updates = None
        try:
            for data in call():
                header, pieces = decode_chunk(data, ps_pb2.PullHeader)
                if header is not None:
                    updates = header.updates
                for piece in pieces:
                    reader.add(piece)
            tensors = reader.finish()
        except grpc.RpcError as e:
            raise error_of(endpoint, f"{what} failed: {details(e)}", e) from None
        except WireError as e:
            raise PserverError(endpoint, f"{what}: answer is malformed: {e}") from None
        if updates is None:
            raise PserverError(endpoint, f"{what}: answer carried no header")
        self.bytes_pulled += reader.nbytes
        return updates, tensors

    def save_tables(self, endpoint: str, directory: str) -> ps_pb2.SaveTablesReply:
        """Ask ``endpoint`` to write its table shards under ``directory`` (its file system)."""
        request = ps_pb2.SaveTablesRequest(trainer_id=self.trainer_id, directory=directory,
                                           layout_digest=self.digest, session=self.sessions.get(endpoint, ""))
        return self._unary(endpoint, "SaveTables", request, f"saving tables to {directory!r}",
                           self.rpc_timeout)

    def _unary(self, endpoint: str, method: str, request, what: str, timeout: float):
        def attempt():
            request.session = self.sessions.get(endpoint, "")  # a new one after a failover
            try:
                return getattr(self._stubs[endpoint], method)(request, timeout=timeout)
            except grpc.RpcError as e:
                raise error_of(endpoint, f"{what} failed: {details(e)}", e) from None
        return self.primaries.run(endpoint, attempt)

    def heartbeat(self, endpoint: str, timeout: float) -> ps_pb2.HeartbeatReply:
        """Tell ``endpoint`` this trainer lives; its answer carries its updates and incarnation."""
        request = ps_pb2.HeartbeatRequest(trainer_id=self.trainer_id, session=self.sessions.get(endpoint, ""))
        return self._unary(endpoint, "Heartbeat", request, f"heartbeat of trainer {self.trainer_id}", timeout)

    def restore(self, endpoint: str, step: int, token: str) -> ps_pb2.RestoreReply:
        """Ask ``endpoint`` to roll back to its checkpoint at ``step`` (once per ``token``)."""
        request = ps_pb2.RestoreRequest(trainer_id=self.trainer_id, checkpoint_step=step, token=token,
                                        layout_digest=self.digest, session=self.sessions.get(endpoint, ""))
        return self._unary(endpoint, "Restore", request,
                           f"roll-back to step {step} asked by trainer {self.trainer_id}", self.rpc_timeout)

    def checkpoint(self, endpoint: str) -> ps_pb2.CheckpointReply:
        """Ask ``endpoint`` to write its part of a checkpoint now."""
        request = ps_pb2.CheckpointRequest(trainer_id=self.trainer_id, layout_digest=self.digest,
                                           session=self.sessions.get(endpoint, ""))
        return self._unary(endpoint, "Checkpoint", request,
                           f"checkpoint asked by trainer {self.trainer_id}", self.rpc_timeout)

    def reduce(self, endpoint: str, key: str, round_: int, op: str,
               values: Sequence[Tuple[str, Sequence[int], Sequence[float]]]) -> ps_pb2.ReduceReply:
        """Combine ``values`` ([(name, shape, float64 data)]) with every live trainer's at ``endpoint``.

        The pserver answers once every trainer it expects has sent its values
        for ``(key, round_)``, or refuses after its barrier_timeout naming the
        missing ones.
        """
        request = ps_pb2.ReduceRequest(
            trainer_id=self.trainer_id, layout_digest=self.digest, session=self.sessions.get(endpoint, ""),
            key=key, round=round_, op=op,
            values=[ps_pb2.ReduceValue(name=n, shape=shape, data=data) for n, shape, data in values])
        return self._unary(endpoint, "Reduce", request, f"round {round_} of reduction {key!r} by trainer "
                           f"{self.trainer_id}", self.barrier_timeout + self.rpc_timeout)

    def submit(self, fn: Callable[[], object]) -> futures.Future:
        """Run ``fn`` on one of the pserver call threads."""
        return self._pool.submit(fn)

    def run_parallel(self, jobs: Dict[str, Callable[[], object]]) -> Dict[str, object]:
        """Run one callable per endpoint concurrently; re-raise the first failure."""
        return results_of({ep: self._pool.submit(fn) for ep, fn in jobs.items()})

    def shutdown(self) -> None:
        """Release channels and threads (without telling the pservers)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        for ch in self._channels.values():
            ch.close()
        for ch, _ in self._lead_calls.values():
            ch.close()
        self._regions.close()
