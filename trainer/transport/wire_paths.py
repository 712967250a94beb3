"""The ways one call's tensors go to a pserver and its answer comes back, and the one rule that picks a way.

A push-pull goes one of four ways, a prefetch one of the middle two:

- :class:`SharedMemoryPath` (``PushPullShared``): a pserver on this host that maps this
  process's regions (:mod:`psproto.shared_memory`) reads the push from one region and writes
  its answer into another; only the regions' addresses travel over gRPC.
- :class:`OneMessagePath` (``PushPullOne``, ``PrefetchOne``): a request of at most
  :data:`~psproto.codec.ONE_MESSAGE_BYTES` of tensors goes as one message, since in gRPC
  Python a client-streamed call costs a thread per call, which dominates small pushes and
  prefetches. A push whose answer fits one message too is answered by one.
- :class:`StreamPath` (``PushPull``, ``Prefetch``): the request streams in chunks.
- :class:`DuringBackwardPath` (``PushPull``): the tensors stream as backward produces them.

:func:`choose_path` is the decision (pure, table-tested); a
:class:`~trainer.transport.connection.Connection` holds one path per way for its process.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple, Union

import grpc
import torch

from psproto import ps_pb2
from psproto.codec import ONE_MESSAGE_BYTES, encode_chunks, encode_into
from psproto.wire import one_message

from .shared_regions import RegionPool
from .status_codes import details

# (dtype, shape) of a tensor an answer may carry, by name; None for a name it must not carry.
DtypeAndShape = Callable[[str], Optional[Tuple[str, list]]]
# The tensor a received name is decoded into.
DecodeInto = Callable[[str], torch.Tensor]
Named = Tuple[str, torch.Tensor]
NamedTensors = List[Named]
# Per pserver endpoint: the (wire name, tensor) pairs a call to it carries.
TensorsByPserver = Dict[str, NamedTensors]

SHARED_MEMORY, ONE_MESSAGE, STREAM, DURING_BACKWARD = (
    "shared memory",
    "one message",
    "stream",
    "during backward",
)
# What a call says of an answer its method streams whatever its size (PrefetchOne): none of it must fit one
# message.
ANSWER_STREAMS = 0


def choose_path(
    request_bytes: int, answer_bytes: Optional[int], shared_memory: bool, during_backward: bool
) -> str:
    """The way a call goes: :data:`DURING_BACKWARD`, :data:`SHARED_MEMORY`, :data:`ONE_MESSAGE` or
    :data:`STREAM`.

    ``request_bytes``: the tensor bytes of the request. ``answer_bytes``: the tensor bytes of the answer,
    which a one-message call must fit in one message (None: not known, so the call streams;
    :data:`ANSWER_STREAMS`: the method streams its answer). ``shared_memory``: whether the pserver maps
    this process's shared memory (none refused so far). ``during_backward``: the tensors stream in as
    backward produces them.
    """
    if during_backward:
        return DURING_BACKWARD
    if answer_bytes is None:
        return STREAM
    if shared_memory:
        return SHARED_MEMORY
    if request_bytes <= ONE_MESSAGE_BYTES and answer_bytes <= ONE_MESSAGE_BYTES:
        return ONE_MESSAGE
    return STREAM


class BackwardTensors:
    """A push's tensors as backward produces them, narrowed to the wire dtype as they go.

    Kept as they stream, so a resend to a shard's new primary replays them;
    ``nbytes`` counts what the latest :meth:`replay` sent.
    """

    def __init__(self, source: Iterable[Named], narrow: Callable[[Iterable[Named]], Iterator[Named]]):
        self._source = iter(source)
        self._narrow = narrow
        self._kept: NamedTensors = []
        self.nbytes = 0

    def replay(self) -> Iterator[Named]:
        """Every tensor: those already sent, then the others as they come; ends when the source does."""
        self.nbytes = 0
        for name, t in self._narrow(self._replayed()):
            self.nbytes += t.numel() * t.element_size()
            yield name, t

    def _replayed(self) -> Iterator[Named]:
        yield from list(self._kept)
        for item in self._source:
            self._kept.append(item)
            yield item


@dataclass(frozen=True)
class Request:
    """What every attempt of one call sends: its tensors, their bytes, and the answer's bytes when known.

    The header is built by each attempt: it carries the session of the
    process the attempt goes to.
    """

    tensors: Union[NamedTensors, BackwardTensors]
    nbytes: int = 0
    answer_bytes: Optional[int] = None


class SharedMemoryRefused(Exception):
    """A push that did not go through shared memory, and counted nowhere: it goes by gRPC instead.

    ``for_good``: the pserver cannot map this process's regions (it runs on
    another host), so every later push to it goes by gRPC too.
    """

    def __init__(self, reason: str, for_good: bool):
        super().__init__(reason)
        self.for_good = for_good


class WirePath(ABC):
    """One way a call goes: it sends one attempt's header and tensors and hands back the answer's messages."""

    @abstractmethod
    def send(self, header, request: Request, timeout: float) -> Iterable[bytes]:
        """Send ``header`` and ``request``'s tensors; the answer's messages (PullChunks), for the caller to
        read.

        A failed call raises ``grpc.RpcError``, when sent or while its answer is read.
        """


class StreamPath(WirePath):
    """The request streams in chunks of ``chunk_bytes`` (PushPull, Prefetch); so does the answer."""

    def __init__(self, call: Callable, chunk_bytes: int):
        self._call = call
        self._chunk_bytes = chunk_bytes

    def send(self, header, request: Request, timeout: float) -> Iterable[bytes]:
        return self._call(encode_chunks(header, request.tensors, self._chunk_bytes), timeout=timeout)


class DuringBackwardPath(WirePath):
    """A push opened before its tensors exist (PushPull): they stream as backward produces them.

    ``request.tensors`` is a :class:`BackwardTensors`: every send replays
    the tensors already sent, so a push resent to a shard's new primary
    carries them all; the call ends when backward's tensors do.
    """

    def __init__(self, call: Callable, chunk_bytes: int):
        self._call = call
        self._chunk_bytes = chunk_bytes

    def send(self, header, request: Request, timeout: float) -> Iterable[bytes]:
        return self._call(encode_chunks(header, request.tensors.replay(), self._chunk_bytes), timeout=timeout)


class OneMessagePath(WirePath):
    """The request goes as one message (PushPullOne, PrefetchOne); ``answer_streams``: the answer may
    stream."""

    def __init__(self, call: Callable, answer_streams: bool):
        self._call = call
        self._answer_streams = answer_streams

    def send(self, header, request: Request, timeout: float) -> Iterable[bytes]:
        answer = self._call(one_message(header, request.tensors, request.nbytes), timeout=timeout)
        return answer if self._answer_streams else (answer,)


class SharedMemoryPath(WirePath):
    """A push and its answer through a pair of shared-memory regions (PushPullShared).

    The pair is this pserver's from ``regions``; it is reused once the
    answer has been read, never after a call that failed (the pserver may
    still write into it). A push whose pieces' meta outgrow the guess, or
    that a pserver refuses before counting it (UNIMPLEMENTED: it cannot map
    the regions), raises :class:`SharedMemoryRefused` when its answer is read.
    """

    def __init__(self, call: Callable, regions: RegionPool, endpoint: str):
        self._call = call
        self._regions = regions
        self._endpoint = endpoint

    def send(self, header, request: Request, timeout: float) -> Iterator[bytes]:
        request_bytes = (
            request.nbytes + 256 + sum(len(name) + 64 for name, _ in request.tensors)
        )  # and pieces' meta
        pair = self._regions.take(self._endpoint, request_bytes, request.answer_bytes + 4096)
        reusable = False
        try:
            length = encode_into(pair.request.view, header, request.tensors)
            if length < 0:
                reusable = True
                raise SharedMemoryRefused("more meta than guessed", for_good=False)
            push = ps_pb2.SharedPush(
                request=pair.request.address(ps_pb2.SharedRegion),
                request_bytes=length,
                answer=pair.answer.address(ps_pb2.SharedRegion),
            )
            try:
                reply = ps_pb2.SharedAnswer.FromString(self._call(push.SerializeToString(), timeout=timeout))
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                reusable = True  # refused before the pserver touched the regions
                raise SharedMemoryRefused(details(e), for_good=True) from None
            yield reply.inline if reply.inline else pair.answer.view[: reply.answer_bytes]
            reusable = True
        finally:
            self._regions.give_back(self._endpoint, pair, reusable=reusable)
