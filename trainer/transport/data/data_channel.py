"""A trainer's data connection to one pserver (one lane): pushes, pulls and prefetches outside gRPC.

The frames are :mod:`psproto.dataplane.frames`', the payloads :mod:`psproto.dataplane.payload`'s
(docs/dataplane.md). A connection is opened after gRPC Hello gave the trainer its session and the pserver's
data port; it proves itself with the job's auth token and that session, over TLS when the job uses TLS. One
call at a time. On the pserver's host, the connection maps a pair of shared-memory regions once and calls
carry only headers: the payload goes into the request region, the answer comes back in the answer region.

A failed call raises :class:`DataCallError`, a ``grpc.RpcError`` with the status the pserver answered (the
gRPC path's statuses): the transport maps both paths' failures through one function
(:mod:`trainer.transport.status_codes`). A broken connection is UNAVAILABLE; it is closed and the next call
opens a new one.
"""

from __future__ import annotations

import os
import socket
import ssl
import time
from typing import Optional, Sequence, Tuple

import grpc
import numpy as np

from psproto.dataplane.frames import (
    ANSWER_SHARED,
    MAP_REGIONS,
    OK,
    SHARED,
    AnswerHeader,
    ConnectionHello,
    FrameError,
    RegionAddress,
    RequestHeader,
    pack_regions,
)
from psproto.shared_memory import Region

from ..shared_regions import region_size

_CODES = {code.value[0]: code for code in grpc.StatusCode}


class DataCallError(grpc.RpcError):
    """A data-channel call that failed: ``code()`` and ``details()`` as a gRPC call's."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def _down(what: str, e: BaseException) -> DataCallError:
    return DataCallError(grpc.StatusCode.UNAVAILABLE, f"data connection {what}: {e}")


class DataChannel:
    """One open data connection to ``address`` (host, port), said hello with ``hello``.

    ``client_context``: TLS (None: plaintext). ``timeout``: the deadline of connecting and of the hello.
    """

    def __init__(
        self,
        address: Tuple[str, int],
        hello: ConnectionHello,
        client_context: Optional[ssl.SSLContext],
        server_hostname: str,
        timeout: float,
    ):
        self.address = address
        self._tls = client_context is not None
        self._head = bytearray(AnswerHeader.SIZE)
        self._inline = np.empty(0, dtype=np.uint8)
        self._outbox = np.zeros(0, dtype=np.uint8)
        self.regions: Optional[Tuple[Region, Region]] = None
        self.sock: Optional[socket.socket] = None
        try:
            sock = socket.create_connection(address, timeout=timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if client_context is not None:
                sock = client_context.wrap_socket(sock, server_hostname=server_hostname)
            sock.sendall(hello.pack())
            self.sock = sock
            self._answer(timeout)
        except DataCallError:
            self.close()
            raise
        except (OSError, FrameError) as e:
            self.close()
            raise _down(f"to {address[0]}:{address[1]} failed", e) from None

    # -- reading ----------------------------------------------------------------------------------

    def _recv_exactly(self, view: memoryview, deadline: float) -> None:
        got, n = 0, view.nbytes
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no answer in time")
            self.sock.settimeout(left)
            if self._tls:
                k = self.sock.recv_into(view[got:])
            else:
                k = self.sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
            if k == 0:
                raise ConnectionError("the pserver closed the data connection")
            got += k

    def _answer(self, timeout: float) -> Tuple[AnswerHeader, np.ndarray]:
        """Read one answer frame: (header, payload); a refusal raises :class:`DataCallError`."""
        deadline = time.monotonic() + timeout
        head = memoryview(self._head)
        self._recv_exactly(head, deadline)
        header = AnswerHeader.unpack(head)
        if header.message_bytes:
            text = bytearray(header.message_bytes)
            self._recv_exactly(memoryview(text), deadline)
            message = text.decode(errors="replace")
        else:
            message = ""
        if header.status != OK:
            raise DataCallError(_CODES.get(header.status, grpc.StatusCode.UNKNOWN), message)
        if header.flags & ANSWER_SHARED:
            if self.regions is None or header.payload_bytes > self.regions[1].size:
                raise FrameError("a shared answer without a region that holds it")
            return header, np.frombuffer(self.regions[1].view, np.uint8, header.payload_bytes)
        if self._inline.size < header.payload_bytes:
            self._inline = np.empty(header.payload_bytes, dtype=np.uint8)
        payload = self._inline[: header.payload_bytes]
        self._recv_exactly(memoryview(payload), deadline)
        return header, payload

    def fileno(self) -> int:
        """The connection's descriptor, to wait on several connections' answers at once (-1: closed)."""
        return self.sock.fileno() if self.sock is not None else -1

    def buffered(self) -> bool:
        """Whether answer bytes were already read off the socket (TLS decrypts ahead): a wait on the
        descriptor would not see them."""
        return self._tls and self.sock is not None and self.sock.pending() > 0

    # -- calls ------------------------------------------------------------------------------------

    def outbox(self, nbytes: int) -> np.ndarray:
        """A buffer of ``nbytes`` for an inline request's payload, reused call after call (grown, zeroed when
        new: padding the writer skips stays zero)."""
        if self._outbox.size < nbytes:
            self._outbox = np.zeros(max(nbytes, 2 * self._outbox.size), dtype=np.uint8)
        return self._outbox[:nbytes]

    def map_regions(self, request_bytes: int, answer_bytes: int, timeout: float) -> None:
        """Give the pserver a pair of shared-memory regions holding these many bytes (new ones if smaller)."""
        if self.regions is not None and (
            self.regions[0].size >= request_bytes and self.regions[1].size >= answer_bytes
        ):
            return
        old, self.regions = self.regions, None
        if old is not None:
            for region in old:
                region.close()
        pair = (Region(region_size(request_bytes)), Region(region_size(answer_bytes)))
        addresses = [RegionAddress(os.getpid(), r.fd, r.size, r.name) for r in pair]
        payload = pack_regions(*addresses)
        try:
            self._exchange(RequestHeader(MAP_REGIONS, payload_bytes=len(payload)), (), [payload], timeout)
        except BaseException:
            for region in pair:
                region.close()
            raise
        self.regions = pair

    def call(
        self,
        header: RequestHeader,
        step_trainers: Sequence[int],
        payload: Sequence,
        timeout: float,
    ) -> Tuple[AnswerHeader, np.ndarray]:
        """Send one request (``payload``: buffers sent in order; with ``SHARED`` in ``header.flags``,
        already in the request region and not sent) and read its answer: (header, payload view, valid until
        the next call)."""
        return self._exchange(header, step_trainers, () if header.flags & SHARED else payload, timeout)

    def send(
        self, header: RequestHeader, step_trainers: Sequence[int], payload: Sequence, timeout: float
    ) -> None:
        """The first half of :meth:`call`: send the request, not waiting for its answer (:meth:`receive`
        reads it). A trainer pushing to several pservers sends to each, then reads each answer, on one
        thread: no hand-over to another thread and back per pserver."""
        try:
            self._send(header, step_trainers, () if header.flags & SHARED else payload, timeout)
        except (OSError, FrameError, TimeoutError) as e:
            raise self._broken(e) from None

    def receive(self, timeout: float) -> Tuple[AnswerHeader, np.ndarray]:
        """The second half of :meth:`call`: the answer of the request :meth:`send` sent."""
        try:
            return self._answer(timeout)
        except DataCallError:
            raise
        except (OSError, FrameError, TimeoutError) as e:
            raise self._broken(e) from None

    def _exchange(
        self, header: RequestHeader, step_trainers: Sequence[int], payload: Sequence, timeout: float
    ) -> Tuple[AnswerHeader, np.ndarray]:
        """Send a request and read its answer; a broken connection (closed by the pserver, reset, a frame
        it cannot be) is closed here and raised UNAVAILABLE, a late answer DEADLINE_EXCEEDED."""
        try:
            self._send(header, step_trainers, payload, timeout)
            return self._answer(timeout)
        except DataCallError:
            raise
        except (OSError, FrameError, TimeoutError) as e:
            raise self._broken(e) from None

    def _broken(self, e: BaseException) -> DataCallError:
        """The connection closed, and the error a call that met ``e`` raises."""
        self.close()
        what = "timed out" if isinstance(e, (TimeoutError, socket.timeout)) else "broke"
        code = grpc.StatusCode.DEADLINE_EXCEEDED if what == "timed out" else grpc.StatusCode.UNAVAILABLE
        return DataCallError(code, f"data connection to {self.address[0]}:{self.address[1]} {what}: {e}")

    def _send(self, header: RequestHeader, step_trainers: Sequence[int], payload: Sequence, timeout: float):
        parts = [header.pack()]
        if header.step_trainers:
            parts.append(np.asarray(step_trainers, dtype="<i4").tobytes())
        parts.extend(memoryview(p).cast("B") for p in payload if len(p))
        self.sock.settimeout(timeout)
        if self._tls:
            for p in parts:
                self.sock.sendall(p)
        else:
            total = sum(memoryview(p).nbytes for p in parts)
            sent = self.sock.sendmsg(parts)
            if sent < total:  # the rest, in order
                views = [memoryview(p).cast("B") for p in parts]
                for v in views:
                    if sent >= v.nbytes:
                        sent -= v.nbytes
                        continue
                    self.sock.sendall(v[sent:])
                    sent = 0

    def close(self) -> None:
        """Close the socket and the regions (idempotent)."""
        sock, self.sock = self.sock, None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass
        regions = self.regions
        if regions:
            for region in regions:
                region.close()
            self.regions = None
