"""One inbound data-channel connection on the pserver: its trainer, its regions, and the request it is
reading.

A connection is read as its bytes arrive (the reactor calls :meth:`InboundConnection.read` when the socket is
readable), without blocking: a header, the step's trainers, then the inline payload into a buffer the
connection keeps and grows (bounded by the pserver's ``max_payload``). A request is handed out once whole;
while it is served nothing more may arrive, so any byte that does is the trainer leaving (end of stream) or
breaking the protocol: either ends the connection.
"""

from __future__ import annotations

import socket
import ssl
from dataclasses import dataclass
from typing import Optional

import numpy as np

from psproto.dataplane.frames import ConnectionHello, FrameError, RequestHeader

_RECV = 1 << 20  # bytes asked of one recv while reading a payload


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

    def __init__(self, sock: socket.socket, hello: ConnectionHello, peer: str, max_payload: int):
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
        self._buffer = np.empty(0, dtype=np.uint8)

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
        if self._buffer.size < self._inline_bytes():
            self._buffer = np.empty(self._inline_bytes(), dtype=np.uint8)

    def _finish(self) -> Request:
        header, trainers = self._header, self._trainers
        payload = self._buffer[: self._inline_bytes()]
        self._header, self._have = None, 0
        self.serving = True
        return Request(header, trainers, payload)

    def close(self) -> None:
        """Close the socket (idempotent); the regions go with the last view of them."""
        try:
            self.sock.close()
        except OSError:
            pass
