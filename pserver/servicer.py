"""The gRPC servicer: checks every request, then hands it to the engine.

Every refusal is a gRPC status with a message naming this pserver and what
was wrong; a refused request changes nothing (gradients are fully received
and checked before the engine sees them).
"""
from __future__ import annotations

import functools
import logging
import threading
from typing import Iterator

import grpc
import torch

from psproto import ps_pb2, ps_pb2_grpc
from psproto.codec import TensorReader, WireError, iter_pieces

from .engine import Engine, EngineError

log = logging.getLogger(__name__)


class _Counters:
    def __init__(self):
        self.lock = threading.Lock()
        self.bytes_in = 0
        self.bytes_out = 0
        self.pushes = 0

    def add(self, bytes_in=0, bytes_out=0, pushes=0):
        with self.lock:
            self.bytes_in += bytes_in
            self.bytes_out += bytes_out
            self.pushes += pushes


def _rpc(method):
    """Turn refusals into gRPC statuses; log anything unexpected as INTERNAL."""
    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except EngineError as e:
            context.abort(e.code, e.message)
        except (WireError, ValueError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"pserver {self.endpoint}: {e}")
    return wrapper


def _rpc_stream(method):
    """Like :func:`_rpc` for server-streaming methods (generators)."""
    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            yield from method(self, request, context)
        except EngineError as e:
            context.abort(e.code, e.message)
        except (WireError, ValueError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"pserver {self.endpoint}: {e}")
    return wrapper


class PserverServicer(ps_pb2_grpc.ParameterServerServicer):
    """Hello / Push / Pull / Close / Stats for one pserver."""

    def __init__(self, engine: Engine, layout_digest: str, chunk_bytes: int):
        self.engine = engine
        self.store = engine.store
        self.endpoint = engine.endpoint
        self.layout_digest = layout_digest
        self.chunk_bytes = chunk_bytes
        self.counters = _Counters()

    def _check_trainer(self, trainer_id: int) -> None:
        if not 0 <= trainer_id < self.engine.trainers:
            raise ValueError(f"trainer id {trainer_id} is out of range [0, {self.engine.trainers})")

    def _check_digest(self, digest: str) -> None:
        if digest != self.layout_digest:
            raise EngineError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"pserver {self.endpoint}: plan mismatch (layout digest {digest!r}, "
                              f"this pserver runs {self.layout_digest!r}); transpile the same "
                              f"program with the same config, pservers and trainers on every role")

    @_rpc
    def Hello(self, request, context):
        self._check_trainer(request.trainer_id)
        self._check_digest(request.layout_digest)
        version = self.engine.hello(request.trainer_id)
        return ps_pb2.HelloReply(version=version, sync_mode=self.engine.sync_mode,
                                 trainers=self.engine.trainers)

    @_rpc
    def Push(self, request_iterator, context):
        first = next(request_iterator, None)
        if first is None or not first.HasField("header"):
            raise ValueError("a push must open with a header (trainer_id, step, layout_digest)")
        header = first.header
        self._check_trainer(header.trainer_id)
        self._check_digest(header.layout_digest)
        if header.step < 0:
            raise ValueError(f"step must be >= 0, got {header.step}")
        reader = TensorReader(self.store.expect)
        for piece in first.pieces:
            reader.add(piece)
        for message in request_iterator:
            if message.HasField("header"):
                raise ValueError("a push carries exactly one header, in its first message")
            for piece in message.pieces:
                reader.add(piece)
        grads = reader.finish()
        for name, g in grads.items():
            if not bool(torch.isfinite(g).all()):
                raise ValueError(f"gradient of {name} from trainer {header.trainer_id} at step "
                                 f"{header.step} holds NaN or Inf; push refused")
        self.counters.add(bytes_in=reader.nbytes, pushes=1)
        applied, version = self.engine.push(header.trainer_id, header.step, grads)
        if not applied:
            log.info("%s: duplicate push from trainer %d for step %d acknowledged, not applied",
                     self.endpoint, header.trainer_id, header.step)
        return ps_pb2.PushReply(applied=applied, version=version)

    @_rpc_stream
    def Pull(self, request, context) -> Iterator[ps_pb2.PullChunk]:
        self._check_trainer(request.trainer_id)
        self._check_digest(request.layout_digest)
        names = list(request.names) or list(self.store.names())
        unknown = [n for n in names if self.store.expect(n) is None]
        if unknown:
            raise ValueError(f"unknown blocks {unknown[:5]}{'...' if len(unknown) > 5 else ''}")
        if request.min_version < 0:
            raise ValueError(f"min_version must be >= 0, got {request.min_version}")
        self.engine.wait_version(request.trainer_id, request.min_version)
        version, tensors = self.engine.read(names)
        header = ps_pb2.PullHeader(version=version)
        first = True
        for pieces in iter_pieces(tensors, self.chunk_bytes):
            yield ps_pb2.PullChunk(header=header if first else None, pieces=pieces)
            first = False
        if first:  # no blocks: still answer with the version
            yield ps_pb2.PullChunk(header=header)
        self.counters.add(bytes_out=sum(t.numel() * t.element_size() for _, t in tensors))

    @_rpc
    def Close(self, request, context):
        self._check_trainer(request.trainer_id)
        return ps_pb2.CloseReply(trainers_left=self.engine.close(request.trainer_id))

    @_rpc
    def Stats(self, request, context):
        engine = self.engine
        with engine.cv:
            alive = sorted(engine.joined - engine.closed)
            version = engine.version
        c = self.counters
        with c.lock:
            return ps_pb2.StatsReply(
                endpoint=self.endpoint, version=version, trainers_alive=alive,
                blocks=len(self.store.blocks), block_bytes=self.store.nbytes,
                bytes_in=c.bytes_in, bytes_out=c.bytes_out, pushes=c.pushes,
                sync_mode=engine.sync_mode)
