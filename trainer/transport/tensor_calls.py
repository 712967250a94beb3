"""TensorCalls: the calls to one pserver that carry tensors: push-pull, pull and prefetch.

Over the data channel when the pserver has one (:mod:`.data`: docs/dataplane.md), except a push
streamed during backward and a pull of some blocks only; else over gRPC. There, each push-pull and
prefetch goes by the way :func:`~trainer.transport.wire_paths.choose_path` picks (a
large push-pull split across :mod:`.lanes`; one the pserver cannot take through shared memory sent again
by gRPC), and every answer is read back into tensors, checked against what the trainer expects. Each
attempt goes to the process the pserver's calls go to now, with its session (:mod:`.shard_link`); under
hot standby a call that finds it gone goes again to the process that leads now (:mod:`.primaries`).
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Dict, Iterable, Optional, Sequence, Tuple

import grpc
import torch

from psproto import ps_pb2
from psproto.codec import TensorReader, WireError, decode_chunk
from transpiler import DistributeTranspilerConfig

from ..errors import DOWN, PserverError
from .connection import Connection
from .contact import Contact
from .data.started import StartedPush
from .narrowing import GradientNarrower
from .primaries import ShardPrimary
from .shard_link import ShardLink, TrainerIdentity
from .status_codes import call_errors, details, error_of
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


def wait_timeout(config: DistributeTranspilerConfig) -> float:
    """The deadline of a call a sync barrier may hold (a push-pull, a pull, a prefetch, a Reduce, a Claim)."""
    return config.barrier_timeout + config.rpc_timeout


class TensorCalls:
    """Push-pull, pull and prefetch to one pserver (see the module doc), and the tensor bytes they moved.

    ``link`` is where each attempt goes and the session it carries, ``primary`` runs each call
    (following the shard's primary), ``narrower`` casts pushed gradients to the wire dtype, and
    ``contact`` learns of every call the pserver heard.
    """

    def __init__(
        self,
        link: ShardLink,
        primary: ShardPrimary,
        identity: TrainerIdentity,
        config: DistributeTranspilerConfig,
        narrower: GradientNarrower,
        contact: Contact,
    ):
        self.endpoint = link.endpoint
        self._link = link
        self._primary = primary
        self._identity = identity
        self._config = config
        self._narrower = narrower
        self._contact = contact
        # Whether the pserver maps this process's shared memory: until it refuses (another host).
        self._shared_memory = config.shared_memory
        self.bytes_pushed = 0
        self.bytes_pulled = 0

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
        verdict on the step (``PserverChannel.claim``). Returns the pserver's step (updates applied) of the
        parameters received.
        """
        if not during_backward and self._link.data_ready:
            return self._data_push_pull(step, tensors, decode_into, position, step_trainers, dropped)
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
        pserver_step = self._primary.run(
            functools.partial(
                self._push_pull_once, header, request, during_backward, what, dtype_and_shape, decode_into
            )
        )
        self.bytes_pushed += request.tensors.nbytes if during_backward else request.nbytes
        return pserver_step

    def start_push_pull(
        self,
        step: int,
        tensors: Iterable[Named],
        decode_into: DecodeInto,
        position: Tuple[int, int] = (0, 0),
        step_trainers: Sequence[int] = (),
        dropped: bool = False,
    ) -> Optional[StartedPush]:
        """:meth:`push_pull`'s request sent over the data channel, its answer read by
        :meth:`StartedPush.finish`; None, having sent nothing, where the call takes :meth:`push_pull`
        (no data port, no connection open yet, lanes, a connection that broke)."""
        if not self._link.data_ready:
            return None
        narrowed = self._narrower.narrow(self.endpoint, list(tensors))
        started = self._link.data.start_push_pull(
            step, narrowed, position, decode_into, step_trainers, dropped, wait_timeout(self._config)
        )
        if started is None:
            return None
        self._contact.begin()
        return StartedPush(
            self.endpoint,
            started,
            self._contact,
            wait_timeout(self._config),
            f"step {step} of trainer {self._identity.trainer_id} (push and pull)",
            functools.partial(
                self._data_push_pull, step, narrowed, decode_into, position, step_trainers, dropped
            ),
            self._count_bytes,
        )

    def _count_bytes(self, sent: int, received: int) -> None:
        self.bytes_pushed += sent
        self.bytes_pulled += received

    def _data_push_pull(self, step, tensors, decode_into, position, step_trainers, dropped) -> int:
        narrowed = self._narrower.narrow(self.endpoint, list(tensors))
        what = f"step {step} of trainer {self._identity.trainer_id} (push and pull)"

        def once() -> int:
            if not self._link.data_ready:  # moved to a process without a data port (say, an older pserver)
                raise PserverError(self.endpoint, f"{what}: no data port", DOWN)
            with self._contact.call(from_start=True), call_errors(self.endpoint, what):
                pserver_step, _, sent, received = self._link.data.push_pull(
                    step, narrowed, position, decode_into, step_trainers, dropped, wait_timeout(self._config)
                )
            self._count_bytes(sent, received)
            return pserver_step

        return self._primary.run(once)

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
        if self._link.lanes.split(way, request.nbytes):
            return self._push_pull_lanes(header, request, what, dtype_and_shape, decode_into)
        try:
            return self._attempt(
                self._link.connection.push_pull_paths[way],
                header,
                request,
                what,
                dtype_and_shape,
                decode_into,
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
                self._link.connection.push_pull_paths[way],
                header,
                request,
                what,
                dtype_and_shape,
                decode_into,
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
                header(session=self._link.session, **lane), part, wait_timeout(self._config)
            )

        return self._link.lanes.push_pull(
            request.tensors,
            self._link.connection,
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
        if self._link.data_ready and list(names) == list(self._link.data.payloads.lane(1, 0).names):
            return self._primary.run(functools.partial(self._data_pull, min_step, decode_into, what))
        return self._primary.run(
            functools.partial(self._pull_once, request, what, dtype_and_shape, decode_into)
        )

    def _data_pull(self, min_step: int, decode_into: DecodeInto, what: str) -> int:
        with self._contact.call(from_start=True), call_errors(self.endpoint, what):
            pserver_step, received = self._link.data.pull(min_step, decode_into, wait_timeout(self._config))
        self.bytes_pulled += received
        return pserver_step

    def _pull_once(
        self, request: Callable, what: str, dtype_and_shape: DtypeAndShape, decode_into: DecodeInto
    ) -> int:
        call = functools.partial(
            self._link.connection.pull,
            request(session=self._link.session),
            timeout=wait_timeout(self._config),
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
        if self._link.data_ready:
            return self._primary.run(functools.partial(self._data_prefetch, min_step, ids, what))
        return self._primary.run(
            functools.partial(self._prefetch_once, header, request, what, dtype_and_shape)
        )

    def _data_prefetch(self, min_step: int, ids, what: str) -> Dict[str, torch.Tensor]:
        with self._contact.call(from_start=True), call_errors(self.endpoint, what):
            rows, received = self._link.data.prefetch(min_step, ids, wait_timeout(self._config))
        self.bytes_pulled += received
        return rows

    def _prefetch_once(
        self, header: Callable, request: Request, what: str, dtype_and_shape: DtypeAndShape
    ) -> Dict[str, torch.Tensor]:
        path = self._link.connection.prefetch_paths[
            choose_path(request.nbytes, request.answer_bytes, False, False)
        ]
        return self._attempt(path, header, request, what, dtype_and_shape, None)[1]

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
        call = functools.partial(
            path.send, header(session=self._link.session), request, wait_timeout(self._config)
        )
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
            with self._contact.call(from_start=sent_at_once):
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
