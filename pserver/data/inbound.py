"""One inbound data-channel connection on the pserver: its trainer, its regions, and the request it is
reading.

A connection is read as its bytes arrive (the reactor calls :meth:`InboundConnection.read` when the socket is
readable), without blocking: a header, the step's trainers, then the inline payload into a buffer (bounded
by the pserver's ``max_payload``). A request is handed out once whole; while it is served nothing more may
arrive, so any byte that does is the trainer leaving (end of stream) or breaking the protocol: either ends
the connection.

The buffer is the connection's only while it reads or serves a request: taken from the port's
:class:`PayloadBuffers` when a payload starts, given back once the payload is consumed (a push counted:
:meth:`InboundConnection.release_payload`) or the request answered. So a thousand trainers' connections
hold no payload each while idle, and a sync step's parked pushes none while they wait for the step: what
the pserver holds grows with the requests being read, not with the sessions.
"""

from __future__ import annotations

import socket
import ssl
import threading
from dataclasses import dataclass
from typing import List, Optional

import numpy as np

from psproto.dataplane.frames import ConnectionHello, FrameError, RequestHeader

_RECV = 1 << 20  # bytes asked of one recv while reading a payload
_NONE = np.empty(0, dtype=np.uint8)
KEPT_BUFFERS = 8  # payload buffers a port keeps for the next requests (about 2 per reactor at work)


class PayloadBuffers:
    """Buffers inline payloads are read into, shared by a port's connections: at most ``keep`` are kept
    between requests (the largest), the rest freed."""

    def __init__(self, keep: int = KEPT_BUFFERS):
        self._keep = keep
        self._free: List[np.ndarray] = []
        self._lock = threading.Lock()  # the port's reactors take and give on their own threads

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer of at least ``nbytes`` (a kept one where one is large enough)."""
        with self._lock:
            for i, buffer in enumerate(self._free):
                if buffer.size >= nbytes:
                    return self._free.pop(i)
        return np.empty(nbytes, dtype=np.uint8)

    def give(self, buffer: np.ndarray) -> None:
        """``buffer`` is no longer read: kept for a later :meth:`take` if among the largest ``keep``."""
        with self._lock:
            self._free.append(buffer)
            if len(self._free) > self._keep:
                del self._free[min(range(len(self._free)), key=lambda i: self._free[i].size)]

    def kept_bytes(self) -> int:
        """Bytes of the buffers kept now."""
        with self._lock:
            return sum(b.size for b in self._free)


class Gone(Exception):
    """The trainer closed its end of the connection (or the connection broke)."""


@dataclass
class Request:
    """A whole request read from a connection: its header, the step's trainers and its inline payload."""

    header: RequestHeader
    step_trainers: np.ndarray  # int32
    payload: np.ndarray  # uint8; empty with SHARED (the payload is in the request region)


class InboundConnection:
    """A trainer's connection to this pserver's data port, after its hello was accepted.

    ``hello`` says who it is (trainer, lane, session); ``regions``, once mapped, the trainer's request
    and answer regions (memoryviews). Reading is :meth:`read`'s; the reactor owning the connection is
    the only thread that reads it or writes it.
    """

    def __init__(
        self,
        sock: socket.socket,
        hello: ConnectionHello,
        peer: str,
        max_payload: int,
        buffers: Optional[PayloadBuffers] = None,
    ):
        self.sock = sock
        self.hello = hello
        self.peer = peer
        self.max_payload = max_payload
        self.regions: Optional[tuple] = None  # (request view, answer view) once mapped
        self.serving = False  # a request of this connection is being served
        self._head = bytearray(RequestHeader.SIZE)
        self._have = 0  # bytes of the current request read so far (header, trainers, payload)
        self._header: Optional[RequestHeader] = None
        self._trainers = np.empty(0, dtype=np.int32)
        self._buffers = buffers if buffers is not None else PayloadBuffers(keep=1)
        self._buffer = _NONE  # the payload's, while a request with one is read or served

    @property
    def trainer_id(self) -> int:
        return self.hello.trainer_id

    def fileno(self) -> int:
        return self.sock.fileno()

    def _recv_into(self, view) -> int:
        try:
            n = self.sock.recv_into(view)
        except (BlockingIOError, ssl.SSLWantReadError, socket.timeout):
            return -1
        except OSError as e:
            raise Gone(str(e)) from None
        if n == 0:
            raise Gone("the trainer closed the connection")
        return n

    def pending(self) -> bool:
        """Whether bytes already decrypted wait in the TLS layer (the selector cannot see them)."""
        return isinstance(self.sock, ssl.SSLSocket) and self.sock.pending() > 0

    def read(self) -> Optional[Request]:
        """Read what arrived; the request once whole, else None. Raises :class:`Gone` or
        :class:`FrameError`."""
        if self.serving:  # nothing may arrive while a request is served
            probe = bytearray(1)
            if self._recv_into(memoryview(probe)) > 0:
                raise FrameError("a request arrived before the answer to the previous one")
            return None
        while True:
            if self._header is None:
                n = self._recv_into(memoryview(self._head)[self._have :])
                if n < 0:
                    return None
                self._have += n
                if self._have < RequestHeader.SIZE:
                    continue
                self._start(RequestHeader.unpack(bytes(self._head), self.max_payload))
            need = self._trainers.nbytes + self._inline_bytes()
            done = self._have - RequestHeader.SIZE
            if done >= need:
                return self._finish()
            target = self._trainers.view(np.uint8) if done < self._trainers.nbytes else None
            if target is not None:
                n = self._recv_into(memoryview(target)[done:])
            else:
                at = done - self._trainers.nbytes
                n = self._recv_into(memoryview(self._buffer)[at : min(self._inline_bytes(), at + _RECV)])
            if n < 0:
                return None
            self._have += n

    def served(self) -> None:
        """The request handed out is answered (or abandoned): the next one may be read."""
        self.serving = False
        self.release_payload()

    def release_payload(self, reuse: bool = True) -> None:
        """The request's inline payload is no longer read: its buffer goes back to the port's; not with
        ``reuse`` False (views of it outlive the request, as a lane's parts held until its push is whole: the
        buffer is then freed with the last of them)."""
        buffer, self._buffer = self._buffer, _NONE
        if buffer.size and reuse:
            self._buffers.give(buffer)

    def map_regions(self, request: memoryview, answer: memoryview) -> None:
        """The trainer's shared-memory regions, mapped here: payloads come in ``request``, answers go in
        ``answer``."""
        self.regions = (request, answer)

    def _inline_bytes(self) -> int:
        header = self._header
        return 0 if header.flags & 1 else header.payload_bytes  # frames.SHARED: the payload is in a region

    def _start(self, header: RequestHeader) -> None:
        self._header = header
        self._trainers = np.empty(header.step_trainers, dtype=np.int32)
        if self._inline_bytes():
            self._buffer = self._buffers.take(self._inline_bytes())

    def _finish(self) -> Request:
        header, trainers = self._header, self._trainers
        payload = self._buffer[: self._inline_bytes()]
        self._header, self._have = None, 0
        self.serving = True
        return Request(header, trainers, payload)

    def close(self) -> None:
        """Close the socket (idempotent); the regions go with the last view of them, the payload buffer with
        the connection (not given back: another thread may close it while its reactor reads into it)."""
        try:
            self.sock.close()
        except OSError:
            pass
