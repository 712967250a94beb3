"""The data port: accepts trainers' data connections, checks who they are, and deals them to reactors.

Every connection is checked before anything else is read from it, as a gRPC call is:

- with TLS configured (``PS_TLS_*``), the connection is TLS, with the same certificates as gRPC's
  port (mutual when the pserver requires client certificates);
- its :class:`~psproto.dataplane.frames.ConnectionHello` must carry the job's auth token when one is set
  (compared in constant time), the plan's layout digest, and the session its trainer holds (from gRPC
  Hello): a connection of a fenced or unknown session is refused with the status the gRPC path gives.

A hello must arrive within ``HELLO_TIMEOUT`` s. The session is checked again on every call (a newer
process may take the trainer id over while the connection lives). One connection per (trainer, slot):
a newer one replaces the older, so connections are bounded by trainers x (lanes + 1).
"""

from __future__ import annotations

import itertools
import logging
import socket
import ssl
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, Optional, Sequence, Tuple

from psproto.dataplane.frames import OK, AnswerHeader, ConnectionHello, FrameError, refusal

from ..rpc.prologue import status_of
from .inbound import InboundConnection, PayloadBuffers
from .reactor import Reactor, send_all

log = logging.getLogger(__name__)

HELLO_TIMEOUT = 10.0
# Threads that read hellos (and make TLS handshakes): a silent client holds one for HELLO_TIMEOUT at most.
HELLO_THREADS = 8
_BACKLOG = 1024

# Checks a hello (token, digest, session); raises a domain refusal. Returns nothing.
CheckHello = Callable[[ConnectionHello], None]


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise FrameError("the connection closed before its hello")
        data += chunk
    return bytes(data)


class DataListener:
    """Bound to ``host:port`` at construction (0: any free port; :attr:`port` says which), so the port is
    known before anything is served; :meth:`serve` starts accepting.

    ``server_context``: TLS for every connection (None: plaintext, as gRPC's port then is).
    """

    def __init__(
        self, host: str, port: int, max_payload: int, server_context: Optional[ssl.SSLContext] = None
    ):
        self._max_payload = max_payload
        self._payload_buffers = PayloadBuffers()  # every connection's, while it reads or serves a request
        self._tls = server_context
        self._sock = socket.create_server((host, port), backlog=_BACKLOG)
        self.port = self._sock.getsockname()[1]
        self._lock = threading.Lock()
        self._by_slot: Dict[Tuple[int, int], InboundConnection] = {}
        self._closed = False
        self._check: Optional[CheckHello] = None
        self._reactors = None
        self._hellos = ThreadPoolExecutor(HELLO_THREADS, thread_name_prefix="data-hello")
        self._thread = threading.Thread(target=self._accept_loop, name="data-listener", daemon=True)

    def serve(self, check: CheckHello, reactors: Sequence[Reactor]) -> None:
        """Accept connections from now on: ``check`` accepts or refuses each hello, ``reactors`` serve
        them."""
        self._check = check
        self._reactors = itertools.cycle(reactors)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, address = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                continue
            # Hellos are read in a pool: a slow or silent client holds one of its threads, for at most
            # HELLO_TIMEOUT, never the accept loop.
            try:
                self._hellos.submit(self._admit, sock, address)
            except RuntimeError:  # closed meanwhile
                sock.close()
                return

    def _admit(self, sock: socket.socket, address) -> None:
        peer = f"{address[0]}:{address[1]}"
        try:
            sock.settimeout(HELLO_TIMEOUT)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_side=True)
            head = _read_exactly(sock, ConnectionHello.head_size())
            hello = ConnectionHello.unpack(head, _read_exactly(sock, ConnectionHello.rest_size(head)))
        except (OSError, FrameError, ssl.SSLError) as e:
            log.info("data connection from %s refused before its hello: %s", peer, e)
            sock.close()
            return
        try:
            self._check(hello)
        except Exception as e:  # noqa: BLE001 - a refusal answers with its status
            code = status_of(e)
            if code is None:
                log.exception("data connection from %s: checking its hello failed", peer)
            status = code.value[0] if code is not None else 13
            try:
                send_all(sock, [refusal(status, str(e))], HELLO_TIMEOUT)
            except OSError:
                pass
            sock.close()
            return
        # Registered before the trainer hears OK: a connection it opens after this one always replaces it.
        connection = InboundConnection(sock, hello, peer, self._max_payload, self._payload_buffers)
        with self._lock:
            if self._closed:
                connection.close()
                return
            older = self._by_slot.get((hello.trainer_id, hello.slot))
            self._by_slot[(hello.trainer_id, hello.slot)] = connection
            reactor = next(self._reactors)
        if older is not None:  # its reactor sees the end of its stream and drops it
            try:
                older.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        try:
            sock.sendall(AnswerHeader(OK).pack())
        except OSError:
            connection.close()
            return
        reactor.adopt(connection)

    def close(self) -> None:
        """Stop accepting (connections already dealt are the reactors' to close)."""
        self._closed = True
        try:  # wakes the accept loop (close alone does not, on Linux)
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._sock.close()
        except OSError:
            pass
        if self._thread.is_alive():
            self._thread.join(5.0)
        self._hellos.shutdown(wait=False, cancel_futures=True)
