"""Fuzzing a pserver's data channel (tests/data/test_data_fuzz.py): the pserver's side of the cases, their
bytes, and the judging of what the pserver sent back.

A case (:class:`DataCase`; the series that make them are fuzz_data_series's) is what one raw connection to
the data port sends: no hello, a bad one, or a valid hello (trainer 0's live session, the job's token, the
plan's digest) followed by requests, whole or cut short. The connection is then half-closed and everything
the pserver sends until it closes is read back (:func:`exchange`), so every case ends: a pserver that
neither answers nor closes within :data:`CALL_TIMEOUT` hangs. :func:`judge` says what is wrong with what
came back: every frame the pserver reads is answered with a refusal (a gRPC status other than OK, INTERNAL
or UNKNOWN, and a message) or ends the connection; a valid hello is answered OK first.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import grpc
import numpy as np
import torch

from psproto.dataplane.frames import (
    ANSWER_SHARED,
    MAGIC,
    MAP_REGIONS,
    OK,
    PUSH_PULL,
    AnswerHeader,
    ConnectionHello,
    FrameError,
    RegionAddress,
    RequestHeader,
    pack_regions,
)
from psproto.dataplane.payload import WIRE_CODES
from psproto.shared_memory import Region
from trainer.transport.data.payloads import PserverPayloads, Push

from .fuzz_cases import FUTURE_STEP, Env
from .fuzz_judge import CALL_TIMEOUT

# The slot of every fuzzing connection: one the live trainers never use (they use slots 0 and 1 of one
# lane), so that no fuzzing connection replaces one of theirs.
LANES, SLOT = 4, 3
CODES = {code.value[0]: code.name for code in grpc.StatusCode}
BAD_STATUSES = {grpc.StatusCode.INTERNAL.value[0], grpc.StatusCode.UNKNOWN.value[0]}
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED.value[0]
UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED.value[0]
ABORTED = grpc.StatusCode.ABORTED.value[0]
DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
# This process's shared-memory regions the shared calls name, by what they hold, and their bytes: "push"
# holds the valid push, "ids" the valid prefetch; "small" is an answer region too small for any answer.
REGIONS = {"push": 1 << 20, "ids": 1 << 16, "answer": 1 << 20, "small": 1024}
# PS_FUZZ_SCALE: SCALE times more generated cases, for a deeper run (as tests/pserver/test_fuzz.py's).
SCALE = int(os.environ.get("PS_FUZZ_SCALE", "1"))
_HELLO = struct.Struct("<4sHHiHHHHHH")  # frames' ConnectionHello, for hellos pack() will not make


@dataclass
class DataCase:
    """One connection's bytes and what must come back.

    ``hello``: the bytes open with a valid hello of this many bytes (its answer must be OK); ``oks``: how
    many answers after it must be OK (the requests before the one under test; None: any answer may be,
    e.g. a mutated pull that is still a valid read); every other answer must be a refusal. ``answered``:
    a refusal must come (not only the close); ``statuses``: the refusal's status must be one of these.
    ``wait``: answers to read (the hello's included) before the half-close, for a call that waits: it
    then gets its own answer at its deadline, instead of ending with its connection.
    """

    desc: str
    data: bytes
    hello: int = 0
    oks: Optional[int] = 0
    answered: bool = False
    statuses: Tuple[int, ...] = ()
    wait: int = 0


@dataclass
class DataFuzz:
    """The pserver under fuzz (``env``: tests/helpers/fuzz_cases's), its data port, the job's token, and
    what the cases are made of: the trainer's payload writer for that pserver, a valid push for
    :data:`FUTURE_STEP`, a valid prefetch, and shared-memory regions of this process (:data:`REGIONS`)."""

    env: Env
    port: int
    token: str
    payloads: PserverPayloads
    push: Push
    push_bytes: bytes
    narrow: Push  # the same push, its gradients narrowed to bfloat16 on the wire
    narrow_bytes: bytes
    prefetch_bytes: bytes
    regions: Dict[str, Region]

    @classmethod
    def of(cls, env: Env, token: str) -> "DataFuzz":
        cluster = env.cluster
        program = cluster.transpiler(0).get_trainer_program()
        mine = [b for b in program.blocks if b.endpoint == cluster.endpoints[0]]
        payloads = PserverPayloads(mine, program.tables)
        tensors = list(env.grads) + [
            ("emb@next", torch.from_numpy(env.own_ids[40:50].copy())),
            ("bag@next", torch.from_numpy(env.own_ids[50:55].copy())),
        ]
        push, out = _written(payloads, tensors)
        narrowed = [(n, t if "@" in n and not n.endswith("@rows") else t.bfloat16()) for n, t in tensors]
        narrow, narrow_out = _written(payloads, narrowed)
        assert narrow.grad_dtype == WIRE_CODES["bfloat16"]
        prefetch = payloads.plan_prefetch(env.prefetch_ids)
        ids = np.zeros(prefetch.layout.nbytes, dtype=np.uint8)
        payloads.write_prefetch(ids, prefetch)
        regions = {name: Region(size) for name, size in REGIONS.items()}
        np.frombuffer(regions["push"].view, np.uint8, out.size)[:] = out
        np.frombuffer(regions["ids"].view, np.uint8, ids.size)[:] = ids
        port = cluster.servers[0].data_port
        return cls(
            env,
            port,
            token,
            payloads,
            push,
            out.tobytes(),
            narrow,
            narrow_out.tobytes(),
            ids.tobytes(),
            regions,
        )

    def close(self) -> None:
        for region in self.regions.values():
            region.close()

    def hello(self, trainer: int = 0, **fields) -> bytes:
        """A hello (valid: trainer 0's live session, the token, the digest) with ``fields`` replaced."""
        base = dict(
            trainer_id=trainer,
            slot=SLOT,
            lanes=LANES,
            token=self.token,
            session=self.env.sessions.get(trainer, ""),
            layout_digest=self.env.digest,
        )
        base.update(fields)
        return ConnectionHello(**base).pack()

    def address(self, region: str) -> RegionAddress:
        """Where region ``region`` of :data:`REGIONS` is, as a map-regions request names it."""
        r = self.regions[region]
        return RegionAddress(os.getpid(), r.fd, r.size, r.name)

    def map_regions(self, request_region: str, answer_region: str) -> bytes:
        """A map-regions request of two of :data:`REGIONS`."""
        payload = pack_regions(self.address(request_region), self.address(answer_region))
        return request(RequestHeader(MAP_REGIONS, payload_bytes=len(payload)), payload)

    def after_hello(self, desc: str, requests: bytes, **expect) -> DataCase:
        """A case of ``requests`` sent after a valid hello."""
        hello = self.hello()
        return DataCase(desc, hello + requests, hello=len(hello), **expect)


def _written(payloads: PserverPayloads, tensors) -> Tuple[Push, np.ndarray]:
    """A one-lane push of ``tensors`` as the trainer plans and writes it."""
    push = payloads.plan_push(tensors, 1, 0, dropped=False)
    out = np.zeros(push.layout.nbytes, dtype=np.uint8)
    payloads.write_push(out, push, 1, 0)
    return push, out


def request(header: RequestHeader, payload: bytes = b"", trainers: Sequence[int] = ()) -> bytes:
    """A request's bytes: ``header``, its step trainers and its inline payload, as given (not checked)."""
    return header.pack() + np.asarray(trainers, dtype="<i4").tobytes() + payload


def push_header(payload: bytes, **fields) -> RequestHeader:
    """A push-pull's header for :data:`FUTURE_STEP` announcing ``payload``, ``fields`` replaced."""
    base = dict(kind=PUSH_PULL, step=FUTURE_STEP, epoch=1, batch=2, attempt=1, payload_bytes=len(payload))
    base.update(fields)
    return RequestHeader(**base)


def raw_hello(
    magic=MAGIC, version=1, kind=0, trainer=0, slot=SLOT, lanes=LANES, parts=(b"", b"", b""), lengths=None
) -> bytes:
    """A hello as the bytes say, whatever they say (``lengths``: declared, else those of ``parts``)."""
    lengths = lengths or tuple(len(p) for p in parts)
    return _HELLO.pack(magic, version, kind, trainer, slot, lanes, *lengths, 0) + b"".join(parts)


# -- sending and judging ------------------------------------------------------------------------


def exchange(port: int, data: bytes, wait: int = 0, timeout: float = CALL_TIMEOUT) -> Tuple[bytes, str]:
    """Send ``data`` on a new connection, half-close it (once ``wait`` answers came), and read until the
    pserver closes: (the bytes received, how it ended: "closed", "reset" (an RST: the pserver closed with
    bytes unread) or "hang")."""
    deadline = time.monotonic() + timeout
    received = bytearray()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(data)
            while wait and len(answers(bytes(received))[0]) < wait:
                sock.settimeout(max(deadline - time.monotonic(), 1e-3))
                chunk = sock.recv(1 << 16)
                if not chunk:
                    return bytes(received), "closed"
                received += chunk
            sock.shutdown(socket.SHUT_WR)
        except socket.timeout:
            return bytes(received), "hang"
        except ConnectionResetError:
            return bytes(received), "reset"
        except OSError:  # EPIPE, ENOTCONN: the pserver closed before it had all
            pass  # what it sent is still there to read
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(received), "hang"
            sock.settimeout(left)
            try:
                chunk = sock.recv(1 << 16)
            except socket.timeout:
                return bytes(received), "hang"
            except ConnectionResetError:
                return bytes(received), "reset"
            if not chunk:
                return bytes(received), "closed"
            received += chunk


@dataclass
class Answer:
    """One answer frame read back: its header, message and inline payload."""

    header: AnswerHeader
    message: str
    payload: bytes

    def __str__(self) -> str:
        return f"{CODES.get(self.header.status, self.header.status)} {self.message[:200]!r}"


def answers(received: bytes) -> Tuple[List[Answer], int]:
    """The whole answer frames in ``received``, and the bytes left after them (a frame cut short)."""
    out, at = [], 0
    while len(received) - at >= AnswerHeader.SIZE:
        header = AnswerHeader.unpack(received[at : at + AnswerHeader.SIZE])  # FrameError: a bad frame
        inline = 0 if header.flags & ANSWER_SHARED else header.payload_bytes
        end = at + AnswerHeader.SIZE + header.message_bytes + inline
        if end > len(received):
            break
        text = received[at + AnswerHeader.SIZE : at + AnswerHeader.SIZE + header.message_bytes]
        out.append(Answer(header, text.decode(errors="replace"), received[end - inline : end]))
        at = end
    return out, len(received) - at


def judge(case: DataCase, received: bytes, ended: str) -> Optional[str]:
    """What is wrong with what came back for ``case``, or None."""
    if ended == "hang":
        return f"neither answered nor closed within {CALL_TIMEOUT}s (a hang)"
    try:
        frames, left = answers(received)
    except FrameError as e:
        return f"an answer that is not a frame: {e}"
    if left and ended == "closed":
        return f"an answer frame cut short ({left} bytes) by the close"
    if case.hello:
        if not frames:
            return None if ended == "reset" else "the valid hello got no answer"
        first = frames.pop(0)
        if first.header.status != OK or first.message:
            return f"the valid hello was refused: {first}"
    refusals = 0
    for i, frame in enumerate(frames):
        status = frame.header.status
        if status == OK:
            if case.oks is not None and i >= case.oks:
                return f"answer {i} is OK, but this request must be refused"
            continue
        if case.oks is not None and i < case.oks:
            return f"request {i} must be answered OK, it was refused: {frame}"
        if status in BAD_STATUSES:
            return f"answered {frame}: an unexpected exception, not a refusal"
        if status not in CODES:
            return f"answered status {status}, no gRPC status"
        if not frame.message.strip():
            return f"refused {CODES[status]} without a message"
        if case.statuses and status not in case.statuses:
            return f"refused {frame}, expected {[CODES[s] for s in case.statuses]}"
        refusals += 1
    if case.answered and not refusals and ended != "reset":
        return "closed without a refusal"
    return None


def show(case: DataCase, nbytes: int = 48) -> str:
    """The case's bytes in hex (the hello left out), shortened."""
    data = case.data[case.hello :]
    head = "hello + " if case.hello else ""
    return f"{head}[{len(data)} B] {data[:nbytes].hex()}{'...' if len(data) > nbytes else ''}"
