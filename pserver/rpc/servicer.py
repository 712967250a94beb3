"""The gRPC servicer: checks every request, then hands it to the engine (or to the Reduce service).

It knows the blocks and tables only through two parts the server hands it:
what a push, pull or prefetch may carry and how a push splits
(:class:`~pserver.engine.contents.Contents`), and what to count, apply and
read (:class:`~pserver.engine.Engine`), never reaching below them. With hot
standby it holds the process's :class:`~pserver.replication.replica.Replica`
too, and the :class:`Incarnation` trainers tell this pserver's state by.

Every method receives the raw request bytes and parses them itself, so
malformed bytes get INVALID_ARGUMENT with a message instead of a generic
deserialisation failure. The step calls (PushPull, PushPullOne,
PushPullShared), Pull and Prefetch bypass the generic protobuf path for
tensor data (see psproto.codec). Every refusal is a gRPC status naming this
pserver and what was wrong; a refused request changes nothing (gradients are
fully received and checked before the engine sees them).

Everything below this module refuses with :mod:`pserver.errors` exceptions;
:data:`~pserver.rpc.prologue.STATUS` is the one place they become gRPC status
codes (:mod:`.prologue`, with what every call goes through). Any other
exception is a bug: answered INTERNAL, its traceback logged.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Dict, Iterator, Optional

import grpc
import numpy as np
import torch

from psproto import ps_pb2
from psproto.codec import ONE_MESSAGE_BYTES, encode_chunks, encode_into
from psproto.wire import SERVICE, one_message

from ..engine import Contents, Engine
from ..engine.services.claims import StepClaims
from ..engine.services.reductions import Reductions, to_values
from ..engine.waits import Parked
from ..errors import BadRequest, NotAllowed
from .buffers import BufferPool
from .counters import Counters
from .lane_pushes import LanePushes
from .mapped_regions import SharedRegions
from .parking import park, parks
from .prologue import parse, read_stream, refusals, trainer_call
from .replica_link import ReplicaServicer
from .sessions import Incarnation, Sessions
from .stretches import Stretches, answered_on_loop

log = logging.getLogger(__name__)


def _finite(g: torch.Tensor) -> bool:
    # One reduction first (cheap); the elementwise pass only when the sum is
    # not finite, which also covers a sum that merely overflowed.
    return bool(torch.isfinite(g.sum())) or bool(torch.isfinite(g).all())


class PserverServicer:
    """Hello / PushPull / Pull / Prefetch / Close / Stats / Reduce: the engine's and the Reduce service's
    front.

    ``replica``: the process's place in its replicated shard (None without replicas); ``incarnation``
    (default: a new one) what trainers tell this pserver's state by; ``stretches`` where parked calls'
    stretches run (:mod:`.stretches`); ``claims`` the Claim service (backup trainers; None: this pserver
    does not decide).
    """

    def __init__(
        self,
        engine: Engine,
        contents: Contents,
        reductions: Reductions,
        layout_digest: str,
        chunk_bytes: int,
        alive_window: float,
        allow_nonfinite: bool = False,
        replica=None,
        incarnation: Optional[Incarnation] = None,
        stretches: Optional[Stretches] = None,
        claims: Optional[StepClaims] = None,
    ):
        self.engine = engine
        self.contents = contents
        self.reductions = reductions
        self.claims = claims  # backup trainers, on the first pserver: who makes each step
        self.replica = replica
        self._incarnation = incarnation if incarnation is not None else Incarnation()
        self.sessions = Sessions(engine.endpoint, alive_window)
        self.allow_nonfinite = allow_nonfinite
        self.started = time.monotonic()
        self.endpoint = engine.endpoint
        self.layout_digest = layout_digest
        self.chunk_bytes = chunk_bytes
        self.counters = Counters()
        self.buffers = BufferPool(contents.block_layout())
        self.lane_pushes = LanePushes(engine.waits, self._release, contents.block_nbytes())
        self.regions = SharedRegions(engine.trainers)
        self.stretches = stretches if stretches is not None else Stretches(allowed=False)

    @property
    def incarnation(self) -> int:
        return self._incarnation.value

    def _serving(self) -> None:
        """Refuse a trainer's call (NotPrimary) on a replica that does not lead its shard."""
        replica = self.replica
        if replica is not None:
            replica.check_serving()

    def _acked(self) -> None:
        """Before an answer that reports the pserver's step: the backup holds every one of them."""
        replica = self.replica
        if replica is not None:
            replica.wait_acked()

    def _check_trainer(self, trainer_id: int) -> None:
        if not 0 <= trainer_id < self.engine.trainers:
            raise BadRequest(f"trainer id {trainer_id} is out of range [0, {self.engine.trainers})")

    def _check_caller(self, request) -> None:
        """A trainer's call (anything but Hello and Stats): its id in range and its session current."""
        self._serving()
        self._check_trainer(request.trainer_id)
        self.sessions.check(request.trainer_id, request.session)

    def _check_digest(self, digest: str) -> None:
        if digest != self.layout_digest:
            raise NotAllowed(
                f"pserver {self.endpoint}: plan mismatch (layout digest {digest!r}, "
                f"this pserver runs {self.layout_digest!r}); transpile the same "
                f"program with the same config, pservers and trainers on every role"
            )

    @refusals
    def Hello(self, data, context):
        request = parse(ps_pb2.HelloRequest, data)
        self._serving()
        self._check_trainer(request.trainer_id)
        self._check_digest(request.layout_digest)
        if not request.incarnation:
            raise BadRequest(
                "Hello needs the trainer process's incarnation (a random nonzero number, one a process)"
            )
        if request.join_at < 0:
            raise BadRequest(f"join_at must be >= 0, got {request.join_at}")
        last_heard, ended = self.engine.presence(request.trainer_id)
        session = self.sessions.hello(
            request.trainer_id, request.incarnation, context.peer(), last_heard, ended
        )
        joined = self.engine.hello(request.trainer_id, request.join_at)
        return ps_pb2.HelloReply(
            start_step=joined.step,
            sync_mode=self.engine.sync_mode,
            trainers=self.engine.trainers,
            incarnation=self.incarnation,
            epoch=joined.position[0],
            batch=joined.position[1],
            checkpoint_step=joined.checkpoint_step,
            counted_step=joined.counted_step,
            session=session,
            applied_step=joined.applied_step,
            others_in_step=joined.others_in_step,
            replica_epoch=self.replica.epoch if self.replica is not None else 0,
        )

    def _read_stream(self, request_iterator, header_type, expect, dest=None, widen=False):
        """(header, reader) of a client stream (:func:`~.prologue.read_stream`), its caller checked as a
        trainer."""

        def check(header) -> None:
            self._check_caller(header)
            self._check_digest(header.layout_digest)
            self.engine.touch(header.trainer_id)

        return read_stream(request_iterator, header_type, expect, check, self._release, dest, widen)

    def _release(self, tensors) -> None:
        # Only dense blocks come from the pool; sparse tensors are sized per push.
        blocks = self.contents.block_names()
        self.buffers.release({n: t for n, t in tensors.items() if n in blocks})

    @parks(stream=True)
    @refusals
    def PushPull(self, request_iterator, context) -> Iterator[bytes]:
        header, tensors = yield from self._push_pull(request_iterator)
        yield from encode_chunks(header, tensors, self.chunk_bytes)

    @parks()
    @refusals
    def PushPullOne(self, data, context) -> Iterator[bytes]:
        # One message each way: no response stream, whose every message and final status the
        # handler waits for (6-7% of job S's throughput on 2 cores).
        yield one_message(*(yield from self._push_pull(iter((data,)), answer_limit=ONE_MESSAGE_BYTES)))

    @parks()
    @refusals
    def PushPullShared(self, data, context) -> Iterator[bytes]:
        # The regions are mapped (or refused: SharedMemoryError) before anything is read or counted.
        request = parse(ps_pb2.SharedPush, data)
        pushed, answer = self.regions.view(request.request), self.regions.view(request.answer)
        if request.request_bytes > len(pushed):
            raise BadRequest(f"a shared push of {request.request_bytes} bytes in a region of {len(pushed)}")
        header, tensors = yield from self._push_pull(
            iter((pushed[: request.request_bytes],)), answer_limit=len(answer)
        )
        self.counters.add(shared_pushes=1)
        n = encode_into(answer, header, tensors)
        if n < 0:  # the pieces' names and shapes did not fit beside the tensors
            yield ps_pb2.SharedAnswer(inline=one_message(header, tensors)).SerializeToString()
        else:
            yield ps_pb2.SharedAnswer(answer_bytes=n).SerializeToString()

    def _push_pull(self, request_iterator, answer_limit: Optional[int] = None):
        """A push, then its answer: (PullHeader, tensors); parks (see :mod:`.parking`).

        ``answer_limit`` bounds the answer's tensor bytes.
        """
        header, counted, answer_ids = yield from self._push(request_iterator, answer_limit=answer_limit)
        # The trainer's next step needs this one applied (sync), or whatever is there (async).
        min_step = header.step + 1 if self.engine.sync_mode else 0
        names = list(self.contents.block_names())
        if header.lanes > 1:  # one lane's call answers its lane's blocks
            names = self.lane_pushes.blocks_of(header.lane, header.lanes)
        return (yield from self._answer_pull(header.trainer_id, min_step, names, counted, answer_ids))

    def _push(self, request_iterator, answer_limit: Optional[int] = None):
        """Read, check and count one push; (header, counted, {table: ids whose rows the answer carries}).

        Parks (:mod:`.parking`) while an async push is past ``max_staleness``, and a lane of a push split
        across lanes until its push is whole (:mod:`.lane_pushes`). A push may carry ``<table>@next`` ids:
        its answer carries their rows too. ``answer_limit``: the tensor bytes the answer may carry; a push
        whose answer would carry more is refused before it counts.
        """
        header, reader = self._read_stream(
            request_iterator, ps_pb2.PushHeader, self.contents.expect, dest=self.buffers.acquire, widen=True
        )
        held = False  # a lane's buffers are held until its push is whole (LanePushes releases them)
        try:
            if header.step < 0:
                raise BadRequest(f"step must be >= 0, got {header.step}")
            if header.epoch < 0 or header.batch < 0:
                raise BadRequest(f"data position must be >= 0, got epoch {header.epoch} batch {header.batch}")
            grads, sparse, answer_ids = self.contents.sort_push(reader.tensors)
            if answer_limit is not None:
                answer_bytes = self.contents.answer_bytes(answer_ids)
                if answer_bytes > answer_limit:
                    room = "one message" if answer_limit == ONE_MESSAGE_BYTES else "the answer's region"
                    raise BadRequest(
                        f"the answer would carry {answer_bytes:,} bytes of tensors, more than {room} "
                        f"holds ({answer_limit:,}): send this push with PushPull"
                    )
            for name, g in [*grads.items(), *((n, rows) for n, (_, rows) in sparse.items())]:
                if not self.allow_nonfinite and not _finite(g):
                    raise BadRequest(
                        f"gradient of {name} from trainer {header.trainer_id} at step {header.step} "
                        f"holds NaN or Inf; push refused (nonfinite_grads='refuse')"
                    )
            if header.lanes > 1:
                self.counters.add(bytes_in=reader.nbytes)
                held = True  # LanePushes.add owns the buffers from here, whatever happens
                ticket = self.lane_pushes.add(
                    header.trainer_id,
                    header.step,
                    header.lane,
                    header.lanes,
                    (grads, sparse),
                    reader.tensors,
                    (header.session, header.attempt),
                )
                counted = yield from self.lane_pushes.settle(
                    ticket, lambda d, s: self._push_whole(header, d, s)
                )
            else:
                counted = yield from self._push_whole(header, grads, sparse, reader.nbytes)
        finally:
            if not held:
                self._release(reader.tensors)
        if not counted:
            log.info(
                "%s: duplicate push from trainer %d for step %d acknowledged, not counted again",
                self.endpoint,
                header.trainer_id,
                header.step,
            )
        return header, counted, answer_ids

    def _push_whole(self, header, grads, sparse, bytes_in: int = 0):
        """Count or apply one whole push (``bytes_in``: its bytes not counted yet); whether it counted
        (False: a duplicate)."""
        backups = {}
        if header.step_trainers or header.dropped:
            if not self.engine.sync_mode or (header.dropped and (grads or sparse)):
                raise BadRequest(
                    "a push with step_trainers or dropped is a sync step's, and a dropped one carries "
                    "no gradients (backup_trainers)"
                )
            backups = dict(step_trainers=tuple(header.step_trainers), dropped=header.dropped)
            if self.claims is not None and header.step_trainers:  # a restarted first pserver learns the set
                self.claims.learn(header.step, header.step_trainers)
        self.counters.add(bytes_in=bytes_in, pushes=1, dropped_pushes=int(header.dropped))
        while True:
            outcome = self.engine.push(
                header.trainer_id,
                header.step,
                grads,
                sparse,
                (header.epoch, header.batch),
                park=True,
                **backups,
            )
            if not isinstance(outcome, Parked):
                break
            yield from park(outcome)  # then push again: it checks the bound anew
        counted, _ = outcome
        if counted:
            self.counters.counted(header.trainer_id, len(grads))
        return counted

    @parks(stream=True)
    @trainer_call(ps_pb2.PullRequest, touch=True)
    def Pull(self, request, context) -> Iterator[bytes]:
        blocks = self.contents.block_names()
        names = list(request.names) or list(blocks)
        if len(set(names)) != len(names):
            raise BadRequest("a pull names some blocks more than once")
        unknown = [n for n in names if n not in blocks]
        if unknown:
            raise BadRequest(f"unknown blocks {unknown[:5]}{'...' if len(unknown) > 5 else ''}")
        if request.min_step < 0:
            raise BadRequest(f"min_step must be >= 0, got {request.min_step}")
        header, tensors = yield from self._answer_pull(request.trainer_id, request.min_step, names)
        yield from encode_chunks(header, tensors, self.chunk_bytes)

    def _answer_pull(
        self,
        trainer_id: int,
        min_step: int,
        names,
        counted: bool = False,
        answer_ids: Optional[Dict[str, np.ndarray]] = None,
    ):
        """Wait for ``min_step``; (PullHeader, the blocks ``names``, the rows of ``answer_ids`` ({table:
        ids})).

        The rows come after the blocks, as of the same update: in sync mode the next step's lookups find
        exactly what a Prefetch would have. Parks (see :mod:`.parking`).
        """
        yield from park(self.engine.park_for_step(trainer_id, min_step))
        self._acked()
        pserver_step, tensors = self.engine.read(names)
        if answer_ids:
            tensors = tensors + self.engine.lookup(answer_ids)[1]
        self.counters.add(bytes_out=sum(t.numel() * t.element_size() for _, t in tensors))
        return ps_pb2.PullHeader(step=pserver_step, counted=counted), tensors

    @parks(stream=True)
    @refusals
    def Prefetch(self, request_iterator, context) -> Iterator[bytes]:
        yield from self._prefetch(request_iterator)

    @parks(stream=True)
    @refusals
    def PrefetchOne(self, data, context) -> Iterator[bytes]:
        yield from self._prefetch(iter((data,)))

    def _prefetch(self, request_iterator) -> Iterator[bytes]:
        header, reader = self._read_stream(
            request_iterator, ps_pb2.PrefetchHeader, self.contents.expect_table
        )
        if header.min_step < 0:
            raise BadRequest(f"min_step must be >= 0, got {header.min_step}")
        ids = self.contents.prefetch_ids(reader.tensors)
        yield from park(self.engine.park_for_step(header.trainer_id, header.min_step))
        self._acked()
        pserver_step, rows = self.engine.lookup(ids)
        yield from encode_chunks(ps_pb2.PullHeader(step=pserver_step), rows, self.chunk_bytes)
        self.counters.add(
            bytes_in=reader.nbytes, prefetches=1, bytes_out=sum(t.numel() * t.element_size() for _, t in rows)
        )

    @trainer_call(ps_pb2.SaveTablesRequest, touch=True)
    def SaveTables(self, request, context):
        if not request.directory:
            raise BadRequest("SaveTables needs a directory")
        if "\0" in request.directory:
            # The file system would refuse it with a plain ValueError, read as a bug here: checked first.
            raise BadRequest("embedded null byte")
        with self.stretches.off_loop():  # its writes hold the engine's lock: no stretch may wait on the loop
            pserver_step, paths = self.engine.save_tables(request.directory)
        log.info(
            "%s: saved %d table shards after %d updates to %s",
            self.endpoint,
            len(paths),
            pserver_step,
            request.directory,
        )
        return ps_pb2.SaveTablesReply(step=pserver_step, paths=paths)

    @answered_on_loop  # a session check, a counter and a lock-free touch: no pool hop
    @trainer_call(ps_pb2.HeartbeatRequest, digest=False)
    def Heartbeat(self, request, context):
        self.counters.heartbeat(request.trainer_id)
        return ps_pb2.HeartbeatReply(step=self.engine.touch(request.trainer_id), incarnation=self.incarnation)

    @trainer_call(ps_pb2.RestoreRequest, touch=True)
    def Restore(self, request, context):
        if not self.engine.sync_mode:
            raise NotAllowed(
                f"pserver {self.endpoint}: Restore is for sync mode; async pservers resume on their own"
            )
        if request.checkpoint_step < 0 or not request.token:
            raise BadRequest(
                f"Restore needs a checkpoint_step >= 0 and a token, got {request.checkpoint_step} "
                f"{request.token!r}"
            )
        restored = self.engine.restore(request.trainer_id, request.checkpoint_step, request.token)
        return ps_pb2.RestoreReply(step=self.engine.step, restored=restored)

    @trainer_call(ps_pb2.CheckpointRequest, touch=True)
    def Checkpoint(self, request, context):
        step, path = self.engine.checkpoint()
        return ps_pb2.CheckpointReply(checkpoint_step=step, path=path)

    @trainer_call(ps_pb2.CloseRequest, digest=False)
    def Close(self, request, context):
        left = self.engine.close(request.trainer_id)
        self._acked()
        return ps_pb2.CloseReply(trainers_left=left)

    @parks()
    @trainer_call(ps_pb2.ReduceRequest, touch=True)
    def Reduce(self, request, context):
        values = to_values((v.name, v.shape, v.data) for v in request.values)
        handle, result = self.reductions.park(
            request.trainer_id, request.key, request.round, request.op, values
        )
        yield from park(handle)
        combined, trainers = result()
        yield ps_pb2.ReduceReply(
            trainers=trainers,
            values=[
                ps_pb2.ReduceValue(name=name, shape=v.shape, data=v.ravel().tolist())
                for name, v in combined.items()
            ],
        )

    @parks()
    @trainer_call(ps_pb2.ClaimRequest, touch=True)
    def Claim(self, request, context):
        if self.claims is None:
            raise NotAllowed(
                f"pserver {self.endpoint} does not decide which trainers make a step: the first pserver "
                f"does, with backup_trainers set"
            )
        handle, verdict = self.claims.park(request.trainer_id, request.step)
        yield from park(handle)
        v = verdict()
        yield ps_pb2.ClaimReply(admitted=v.admitted, trainers=v.trainers)

    @refusals
    def Stats(self, data, context):
        parse(ps_pb2.StatsRequest, data)
        replica = self.replica.stats() if self.replica is not None else None
        return self.counters.stats_reply(
            self.endpoint, self.engine.stats(), self.incarnation, time.monotonic() - self.started, replica
        )

    def handlers(self) -> Dict[str, grpc.RpcMethodHandler]:
        """The service's handlers by method name: raw-bytes requests (parsed here), encoded replies.

        The parking methods' behaviours carry ``parking`` (:mod:`.parking`):
        :class:`~.aio.Parking` gives them asyncio handlers.
        """
        serialize = lambda m: m.SerializeToString()  # noqa: E731
        handlers = {
            "Hello": grpc.unary_unary_rpc_method_handler(self.Hello, response_serializer=serialize),
            "Pull": grpc.unary_stream_rpc_method_handler(self.Pull),  # yields encoded bytes
            "Prefetch": grpc.stream_stream_rpc_method_handler(self.Prefetch),
            "PushPull": grpc.stream_stream_rpc_method_handler(self.PushPull),
            "PushPullOne": grpc.unary_unary_rpc_method_handler(self.PushPullOne),
            "PushPullShared": grpc.unary_unary_rpc_method_handler(self.PushPullShared),
            "PrefetchOne": grpc.unary_stream_rpc_method_handler(self.PrefetchOne),
            "SaveTables": grpc.unary_unary_rpc_method_handler(self.SaveTables, response_serializer=serialize),
            "Close": grpc.unary_unary_rpc_method_handler(self.Close, response_serializer=serialize),
            "Heartbeat": grpc.unary_unary_rpc_method_handler(self.Heartbeat, response_serializer=serialize),
            "Restore": grpc.unary_unary_rpc_method_handler(self.Restore, response_serializer=serialize),
            "Checkpoint": grpc.unary_unary_rpc_method_handler(self.Checkpoint, response_serializer=serialize),
            "Stats": grpc.unary_unary_rpc_method_handler(self.Stats, response_serializer=serialize),
            "Reduce": grpc.unary_unary_rpc_method_handler(self.Reduce, response_serializer=serialize),
            "Claim": grpc.unary_unary_rpc_method_handler(self.Claim, response_serializer=serialize),
        }
        handlers.update(ReplicaServicer(self).handlers())
        return handlers

    def add_to_server(self, server, adapt: Callable[[Dict[str, grpc.RpcMethodHandler]], Dict] = dict) -> None:
        """Register :meth:`handlers` on ``server`` through ``adapt`` (asyncio: :meth:`.aio.Parking.adapt`)."""
        # Registered, not generic: gRPC queues each method's arrived calls apart and the asyncio server
        # takes them up in parallel, so a heartbeat is taken up behind heartbeats, not a thousand pushes.
        server.add_registered_method_handlers(SERVICE, adapt(self.handlers()))
