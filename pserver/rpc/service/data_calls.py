"""The data calls of the service: a trainer's pushes, pulls and prefetches (the tensors, both ways).

PushPull, PushPullOne and PushPullShared push one step's gradients and answer with the blocks (and rows) the
next step needs; Pull and Prefetch read blocks and table rows. They bypass the generic protobuf path for
tensor data (see psproto.codec): each reads the raw request bytes itself. A refused request changes nothing:
gradients are fully received and checked before the engine sees them. The calls that wait (a sync step,
``min_step``, staleness, a push split across lanes) park (:mod:`pserver.rpc.parking`).
"""

from __future__ import annotations

import logging
from typing import Dict, Iterator, Optional

import grpc
import numpy as np
import torch

from psproto import ps_pb2
from psproto.codec import ONE_MESSAGE_BYTES, encode_chunks, encode_into
from psproto.wire import one_message

from ...engine import Contents, Engine
from ...engine.services.claims import StepClaims
from ...engine.waits import Parked
from ...errors import BadRequest
from ..buffers import BufferPool
from ..counters import Counters
from ..lane_pushes import LanePushes
from ..mapped_regions import SharedRegions
from ..parking import park, parks
from ..prologue import CALLS_LOG, CallerChecks, parse, read_stream, refusals, trainer_call

log = logging.getLogger(CALLS_LOG)


def _finite(g: torch.Tensor) -> bool:
    # One reduction first (cheap); the elementwise pass only when the sum is
    # not finite, which also covers a sum that merely overflowed.
    return bool(torch.isfinite(g.sum())) or bool(torch.isfinite(g).all())


class DataCalls:
    """PushPull / PushPullOne / PushPullShared / Pull / Prefetch / PrefetchOne: the engine's data front.

    What a request may carry and how a push splits is ``contents``'s to say; the engine counts, applies and
    reads. ``allow_nonfinite``: a gradient with NaN or Inf is applied, not refused. ``claims``: the Claim
    service on the first pserver with backup trainers (None elsewhere), told the trainers of a step a push
    names. Owns the receive buffers, the lanes of pushes split across calls and the shared-memory regions
    of trainers on this host.
    """

    def __init__(
        self,
        engine: Engine,
        contents: Contents,
        checks: CallerChecks,
        counters: Counters,
        chunk_bytes: int,
        allow_nonfinite: bool = False,
        claims: Optional[StepClaims] = None,
    ):
        self.engine = engine
        self.contents = contents
        self.checks = checks
        self.counters = counters
        self.endpoint = engine.endpoint
        self.chunk_bytes = chunk_bytes
        self.allow_nonfinite = allow_nonfinite
        self.claims = claims  # backup trainers, on the first pserver: who makes each step
        self.buffers = BufferPool(contents.block_layout())
        self.lane_pushes = LanePushes(engine.waits, self._release, contents.block_nbytes())
        self.regions = SharedRegions(engine.trainers)

    def _read_stream(self, request_iterator, header_type, expect, dest=None, widen=False):
        """(header, reader) of a client stream (:func:`~pserver.rpc.prologue.read_stream`), its caller
        checked as a trainer."""

        def check(header) -> None:
            self.checks.caller(header)
            self.checks.digest(header.layout_digest)
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
        """A push, then its answer: (PullHeader, tensors); parks (see :mod:`pserver.rpc.parking`).

        ``answer_limit`` bounds the answer's tensor bytes.
        """
        header, counted, answer_ids = yield from self._push(request_iterator, answer_limit=answer_limit)
        min_step = self.engine.mode.answer_step(header.step)
        names = list(self.contents.block_names())
        if header.lanes > 1:  # one lane's call answers its lane's blocks
            names = self.lane_pushes.blocks_of(header.lane, header.lanes)
        return (yield from self._answer_pull(header.trainer_id, min_step, names, counted, answer_ids))

    def _push(self, request_iterator, answer_limit: Optional[int] = None):
        """Read, check and count one push; (header, counted, {table: ids whose rows the answer carries}).

        Parks (:mod:`pserver.rpc.parking`) while an async push is past ``max_staleness``, and a lane of a
        push split across lanes until its push is whole (:mod:`pserver.rpc.lane_pushes`). A push may carry
        ``<table>@next`` ids: its answer carries their rows too. ``answer_limit``: the tensor bytes the
        answer may carry; a push whose answer would carry more is refused before it counts.
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
                    ticket, lambda d, s: self.count_push(header, d, s)
                )
            else:
                counted = yield from self.count_push(header, grads, sparse, reader.nbytes)
        finally:
            if not held:
                self._release(reader.tensors)
        if not counted and not header.dropped:  # a dropped push (backup trainers) is never counted
            log.info(
                "%s: duplicate push from trainer %d for step %d acknowledged, not counted again",
                self.endpoint,
                header.trainer_id,
                header.step,
            )
        return header, counted, answer_ids

    def count_push(self, header, grads, sparse, bytes_in: int = 0):
        """Count or apply one whole push (``bytes_in``: its bytes not counted yet); whether it counted
        (False: a duplicate). Parks while an async push is past ``max_staleness``.

        ``header``: the push's trainer_id, step, epoch, batch, step_trainers and dropped (a ``PushHeader``
        on the gRPC path, :class:`pserver.data.calls.PushHead` on the data channel's), handed as they
        are to the engine's mode (:mod:`pserver.engine.modes`), which checks them first.
        """
        self.engine.mode.check_push(header.step_trainers, header.dropped, grads, sparse)
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
                step_trainers=header.step_trainers,
                dropped=header.dropped,
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
        exactly what a Prefetch would have. Parks (see :mod:`pserver.rpc.parking`).
        """
        pserver_step, tensors = yield from self.read_answer(trainer_id, min_step, names, answer_ids)
        return ps_pb2.PullHeader(step=pserver_step, counted=counted), tensors

    def read_answer(self, trainer_id: int, min_step: int, names, answer_ids: Optional[Dict[str, np.ndarray]]):
        """Wait for ``min_step``; (the pserver's step, ``[(name, tensor)]``: the blocks ``names``, then the
        rows of ``answer_ids`` per table). Parks (see :mod:`pserver.rpc.parking`)."""
        yield from park(self.engine.park_for_step(trainer_id, min_step))
        self.checks.acked()
        pserver_step, tensors = self.engine.read(names)
        if answer_ids:
            tensors = tensors + self.engine.lookup(answer_ids)[1]
        self.counters.add(bytes_out=sum(t.numel() * t.element_size() for _, t in tensors))
        return pserver_step, tensors

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
        self.checks.acked()
        pserver_step, rows = self.engine.lookup(ids)
        yield from encode_chunks(ps_pb2.PullHeader(step=pserver_step), rows, self.chunk_bytes)
        self.counters.add(
            bytes_in=reader.nbytes, prefetches=1, bytes_out=sum(t.numel() * t.element_size() for _, t in rows)
        )

    def handlers(self) -> Dict[str, grpc.RpcMethodHandler]:
        """These calls' handlers by method name: raw-bytes requests (parsed here), encoded answers."""
        return {
            "Pull": grpc.unary_stream_rpc_method_handler(self.Pull),  # yields encoded bytes
            "Prefetch": grpc.stream_stream_rpc_method_handler(self.Prefetch),
            "PushPull": grpc.stream_stream_rpc_method_handler(self.PushPull),
            "PushPullOne": grpc.unary_unary_rpc_method_handler(self.PushPullOne),
            "PushPullShared": grpc.unary_unary_rpc_method_handler(self.PushPullShared),
            "PrefetchOne": grpc.unary_stream_rpc_method_handler(self.PrefetchOne),
        }
