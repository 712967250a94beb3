"""The data channel's frames: how pushes, pulls and prefetches travel outside gRPC (version 1).

gRPC carries control (Hello, sessions, Stats, health, checkpoints, replication); the tensor bytes of
a push-pull, pull or prefetch go over a data channel: a plain TCP connection (TLS-wrapped when the
job uses TLS) from a trainer to its pserver's data port, which the pserver names in its HelloReply
(``data_port``). docs/dataplane.md is the whole story; this module is the byte layout both sides
share, little-endian throughout:

- **Connection**: the client sends a :class:`ConnectionHello` (the job's auth token, the trainer's
  session from gRPC Hello, the plan's layout digest); the server answers an :class:`AnswerHeader`
  whose status is OK or the refusal, with its message. A refused connection is closed.
- **Calls**: one at a time per connection. A :class:`RequestHeader`, the step's trainers (int32,
  backup trainers), then the payload, inline or, with :data:`SHARED`, in the request region the
  connection mapped (:data:`MAP_REGIONS`). The answer: an :class:`AnswerHeader`, its message (UTF-8,
  empty when OK), then its payload, inline or in the answer region. The payloads' layout is
  :mod:`psproto.dataplane.payload`'s.

A status is a gRPC status code's value (``grpc.StatusCode.X.value[0]``): the data channel refuses
exactly as the gRPC methods do, and a trainer reads both through the same mapping.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Tuple

from ..lane_blocks import MAX_LANES

MAGIC = b"PSDC"
VERSION = 1

# Request kinds.
PUSH_PULL = 1  # a step's gradients; the answer: the blocks after it (sync: once the step applied), rows asked
PULL = 2  # the blocks once the pserver's step reaches min_step
PREFETCH = 3  # rows of ids, once the pserver's step reaches min_step
MAP_REGIONS = 4  # the connection's shared-memory regions (payload: RegionPair); answered without payload
HEARTBEAT = 5  # a sign of life (no payload); the answer: the pserver's step, its incarnation (int64 payload)
KINDS = {
    PUSH_PULL: "push-pull",
    PULL: "pull",
    PREFETCH: "prefetch",
    MAP_REGIONS: "map-regions",
    HEARTBEAT: "heartbeat",
}

# Request flags.
SHARED = 1  # the payload is in the request region, the answer goes into the answer region
DROPPED = 2  # backup trainers: this trainer was dropped from the step; the push carries no gradients
FLAGS = SHARED | DROPPED

# Answer flags.
COUNTED = 1  # PUSH_PULL: the push counted (False: a duplicate of one already counted)
ANSWER_SHARED = 2  # the answer's payload is in the answer region

OK = 0

# Bounds that refuse a frame before anything is allocated for it.
MAX_TOKEN = 4096
MAX_SESSION = 256
MAX_DIGEST = 256
MAX_STEP_TRAINERS = 1 << 16
MAX_MESSAGE = 1 << 16
# MAX_LANES (psproto.lane_blocks): a hello or a request names at most the lanes a push-pull may be split
# across (``push_lanes``); more could not be served.


class FrameError(ValueError):
    """A frame that does not follow this layout: the connection that sent it is closed."""


_HELLO = struct.Struct(
    "<4sHHiHHHHHH"
)  # magic, version, kind, trainer, slot, lanes, token, session, digest, pad


@dataclass(frozen=True)
class ConnectionHello:
    """The first frame of a connection: who connects, proving it with the token and its session.

    ``slot``: which of the trainer's connections to this pserver it is: ``0 .. lanes - 1`` carry its
    push-pulls (one lane each) and pulls, ``lanes`` its prefetches (a feed thread's, while a step pushes).
    A newer connection of a slot replaces the older.
    """

    trainer_id: int
    slot: int
    lanes: int
    token: str
    session: str
    layout_digest: str

    def pack(self) -> bytes:
        token, session, digest = (s.encode() for s in (self.token, self.session, self.layout_digest))
        if len(token) > MAX_TOKEN or len(session) > MAX_SESSION or len(digest) > MAX_DIGEST:
            raise FrameError("token, session or layout digest too long for a connection hello")
        head = _HELLO.pack(
            MAGIC,
            VERSION,
            0,
            self.trainer_id,
            self.slot,
            self.lanes,
            len(token),
            len(session),
            len(digest),
            0,
        )
        return head + token + session + digest

    @staticmethod
    def head_size() -> int:
        """Bytes of the fixed part; :meth:`rest_size` tells how many follow."""
        return _HELLO.size

    @staticmethod
    def rest_size(head: bytes) -> int:
        """Bytes of the variable part after ``head``; :class:`FrameError` if ``head`` is not a hello."""
        magic, version, kind, _, slot, lanes, token, session, digest, _ = _HELLO.unpack(head)
        if magic != MAGIC:
            raise FrameError("not a data channel connection (bad magic)")
        if version != VERSION:
            raise FrameError(f"data channel version {version}; this pserver speaks {VERSION}")
        if kind != 0 or not 1 <= lanes <= MAX_LANES or slot > lanes:
            raise FrameError(f"bad connection hello: kind {kind}, slot {slot} of {lanes} lanes")
        if token > MAX_TOKEN or session > MAX_SESSION or digest > MAX_DIGEST:
            raise FrameError("connection hello: token, session or digest too long")
        return token + session + digest

    @classmethod
    def unpack(cls, head: bytes, rest: bytes) -> "ConnectionHello":
        """The hello of ``head`` (:meth:`head_size` bytes) and ``rest`` (:meth:`rest_size` bytes)."""
        _, _, _, trainer, slot, lanes, token, session, digest, _ = _HELLO.unpack(head)
        if len(rest) != token + session + digest:
            raise FrameError("connection hello truncated")
        # The lengths count bytes: each part is cut from the bytes, then decoded on its own.
        parts = (rest[:token], rest[token : token + session], rest[token + session :])
        try:
            text = [bytes(p).decode() for p in parts]
        except UnicodeDecodeError:
            raise FrameError("connection hello: token, session or digest not UTF-8") from None
        return cls(trainer, slot, lanes, *text)


# kind, flags, grad dtype code, lanes, lane, pad, n step trainers, step, min_step, epoch, batch, attempt,
# payload bytes: 64 bytes.
_REQUEST = struct.Struct("<BBBBBxxxIqqqqqQ4x")


@dataclass(frozen=True)
class RequestHeader:
    """One call's header. ``grad_dtype``: :data:`psproto.dataplane.payload.WIRE_DTYPES` code of the dense
    gradients (0: the blocks' own dtype); ``payload_bytes``: inline bytes that follow, or bytes in the
    request region with :data:`SHARED`."""

    kind: int
    flags: int = 0
    grad_dtype: int = 0
    lanes: int = 1
    lane: int = 0
    step_trainers: int = 0
    step: int = 0
    min_step: int = 0
    epoch: int = 0
    batch: int = 0
    attempt: int = 0
    payload_bytes: int = 0

    SIZE = _REQUEST.size

    def pack(self) -> bytes:
        return _REQUEST.pack(
            self.kind,
            self.flags,
            self.grad_dtype,
            self.lanes,
            self.lane,
            self.step_trainers,
            self.step,
            self.min_step,
            self.epoch,
            self.batch,
            self.attempt,
            self.payload_bytes,
        )

    @classmethod
    def unpack(cls, data, max_payload: int) -> "RequestHeader":
        """The header in ``data`` (:attr:`SIZE` bytes), checked; :class:`FrameError` says what is wrong."""
        header = cls(*_REQUEST.unpack(data))
        if header.kind not in KINDS:
            raise FrameError(f"unknown request kind {header.kind}")
        if header.flags & ~FLAGS:
            raise FrameError(f"unknown request flags {header.flags:#x}")
        if not 1 <= header.lanes <= MAX_LANES or header.lane >= header.lanes:
            raise FrameError(f"lane {header.lane} of {header.lanes}")
        if header.step_trainers > MAX_STEP_TRAINERS:
            raise FrameError(f"{header.step_trainers} step trainers")
        if header.payload_bytes > max_payload:
            raise FrameError(f"a payload of {header.payload_bytes} bytes; this pserver takes {max_payload}")
        return header


_ANSWER = struct.Struct("<BBxxIqQ")  # status, flags, message bytes, pserver step, payload bytes


@dataclass(frozen=True)
class AnswerHeader:
    """An answer's header: ``status`` (:data:`OK` or a gRPC status code's value), its message's bytes,
    the pserver's step, the payload's bytes (inline, or in the answer region with :data:`ANSWER_SHARED`)."""

    status: int = OK
    flags: int = 0
    message_bytes: int = 0
    step: int = 0
    payload_bytes: int = 0

    SIZE = _ANSWER.size

    def pack(self) -> bytes:
        return _ANSWER.pack(self.status, self.flags, self.message_bytes, self.step, self.payload_bytes)

    @classmethod
    def unpack(cls, data) -> "AnswerHeader":
        header = cls(*_ANSWER.unpack(data))
        if header.message_bytes > MAX_MESSAGE:
            raise FrameError(f"an answer message of {header.message_bytes} bytes")
        return header


def refusal(status: int, message: str) -> bytes:
    """An answer frame refusing a call (or a connection) with ``status`` and ``message``, no payload."""
    text = message.encode()[:MAX_MESSAGE]
    return AnswerHeader(status, 0, len(text)).pack() + text


_REGION = struct.Struct("<qiQ")  # pid, fd, size; then the name's length (u16) and the name


@dataclass(frozen=True)
class RegionAddress:
    """A shared-memory region of the trainer's process, as :func:`psproto.shared_memory.map_region` takes
    it."""

    pid: int
    fd: int
    size: int
    name: str


def pack_regions(request: RegionAddress, answer: RegionAddress) -> bytes:
    """A :data:`MAP_REGIONS` payload: the connection's request and answer regions."""
    out = b""
    for r in (request, answer):
        name = r.name.encode()
        out += _REGION.pack(r.pid, r.fd, r.size) + struct.pack("<H", len(name)) + name
    return out


def unpack_regions(data: bytes) -> Tuple[RegionAddress, RegionAddress]:
    """The two regions of a :data:`MAP_REGIONS` payload; :class:`FrameError` if it is not one."""
    out, at = [], 0
    try:
        for _ in range(2):
            pid, fd, size = _REGION.unpack_from(data, at)
            at += _REGION.size
            (n,) = struct.unpack_from("<H", data, at)
            at += 2
            name = bytes(data[at : at + n]).decode()
            if len(name) != n:
                raise FrameError("region name truncated")
            at += n
            out.append(RegionAddress(pid, fd, size, name))
    except (struct.error, UnicodeDecodeError):
        raise FrameError("not a region pair") from None
    if at != len(data):
        raise FrameError("trailing bytes after a region pair")
    return out[0], out[1]
