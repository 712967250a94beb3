"""Reactors: the threads that serve data-channel connections, with no thread parked per waiting call.

A pserver runs a few reactors (``data_reactors``); each owns the connections the listener dealt it and
waits on all of them at once (``selectors``). When a connection's request is whole, the reactor runs
the call: a generator (one of the data calls) that yields a
:class:`~pserver.engine.waits.Parked` handle where it waits (a sync step's barrier, ``min_step``, an
async push past ``max_staleness``, a push in lanes not yet whole) and finally an :class:`Answer`. A
parked call holds no thread: the thread that ends the wait (the one that applied the step, under the
engine's lock) only queues the call back to its reactor, which runs the rest and sends the answer.
Each wait's deadline is the reactor's to keep (:meth:`Parked.expire`); a trainer that goes away while
its call waits (end of stream) has the wait cancelled and its connection closed.

An exception a call raises is its refusal: answered with the status :func:`pserver.rpc.prologue.status_of`
picks (the gRPC path's), or INTERNAL with the traceback logged. The connection stays open after a
refusal; it closes on a frame that breaks the protocol.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import select
import selectors
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Deque, Iterator, List, Optional, Sequence

from psproto.dataplane.frames import ANSWER_SHARED, OK, AnswerHeader, FrameError, refusal

from ..engine.waits import Parked
from ..rpc.prologue import status_of
from .inbound import Gone, InboundConnection, Request

log = logging.getLogger(__name__)

INTERNAL = 13  # grpc.StatusCode.INTERNAL's value


@dataclass
class Answer:
    """What a call answers: the pserver's step, flags, and its payload as buffers to send in order (inline),
    or ``shared_bytes`` already written into the connection's answer region."""

    step: int = 0
    flags: int = 0
    buffers: Sequence = ()
    shared_bytes: int = -1

    def frame(self) -> List:
        """The answer frame: header then the payload's buffers (none with a shared answer)."""
        if self.shared_bytes >= 0:
            head = AnswerHeader(OK, self.flags | ANSWER_SHARED, 0, self.step, self.shared_bytes)
            return [head.pack()]
        views = [memoryview(b).cast("B") for b in self.buffers]
        head = AnswerHeader(OK, self.flags, 0, self.step, sum(v.nbytes for v in views))
        return [head.pack(), *views]


# A call: the generator a request starts (see the module doc).
Serve = Callable[[InboundConnection, Request], Iterator]


def send_all(sock: socket.socket, buffers: Sequence, timeout: float) -> None:
    """Send ``buffers`` in order on the non-blocking ``sock``, waiting at most ``timeout`` s for room."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    deadline = time.monotonic() + timeout
    tls = isinstance(sock, ssl.SSLSocket)
    while views:
        try:
            sent = sock.send(views[0]) if tls else sock.sendmsg(views[:512])
        except (BlockingIOError, ssl.SSLWantWriteError):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the trainer did not read its answer within {timeout:g} s") from None
            select.select([], [sock], [], left)
            continue
        while sent:
            if sent >= views[0].nbytes:
                sent -= views.pop(0).nbytes
            else:
                views[0] = views[0][sent:]
                sent = 0


@dataclass(order=True)
class _Deadline:
    at: float
    order: int
    handle: Parked = field(compare=False)


class _Call:
    """A call in progress on one connection: its generator and the wait it is parked on, if any."""

    __slots__ = ("connection", "answers", "parked", "ended")

    def __init__(self, connection: InboundConnection, answers: Iterator):
        self.connection = connection
        self.answers = answers
        self.parked: Optional[Parked] = None
        self.ended = False

    def park(self, handle: Optional[Parked]) -> None:
        """The call waits on ``handle`` now (None: it runs)."""
        self.parked = handle

    def end(self) -> None:
        """The call is over (answered, refused or abandoned): its connection may read the next request."""
        self.ended = True
        self.connection.served()


class Reactor:
    """One reactor thread (see the module doc): ``serve`` starts a call; ``send_timeout`` bounds an answer's
    send; ``on_call(connection, starting)`` hears each call's start and end (liveness)."""

    def __init__(
        self,
        name: str,
        serve: Serve,
        send_timeout: float,
        on_call: Callable[[InboundConnection, bool], None] = lambda connection, starting: None,
    ):
        self._serve = serve
        self._send_timeout = send_timeout
        self._on_call = on_call
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._inbox: Deque[Callable[[], None]] = collections.deque()
        self._deadlines: List[_Deadline] = []
        self._order = itertools.count()
        self._calls = {}  # connection -> _Call in progress
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- from any thread --------------------------------------------------------------------------

    def adopt(self, connection: InboundConnection) -> None:
        """Serve ``connection`` from now on (its socket non-blocking)."""
        self._post(lambda: self._register(connection))

    def stop(self, timeout: float = 5.0) -> None:
        """Close every connection and end the thread (calls still parked end with their waits)."""
        self._stopping = True
        self._wake()
        self._thread.join(timeout)

    def _post(self, fn: Callable[[], None]) -> None:
        self._inbox.append(fn)
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):  # full: a wake-up is pending anyway; closed: stopping
            pass

    # -- on the reactor's thread ------------------------------------------------------------------

    def _register(self, connection: InboundConnection) -> None:
        connection.sock.setblocking(False)
        self._selector.register(connection.sock, selectors.EVENT_READ, connection)
        self._readable(connection)  # bytes may have come with the hello

    def _run(self) -> None:
        try:
            while not self._stopping:
                timeout = None
                if self._deadlines:
                    timeout = max(0.0, self._deadlines[0].at - time.monotonic())
                for key, _ in self._selector.select(timeout):
                    if key.data is None:
                        self._drain_wakeups()
                    else:
                        self._readable(key.data)
                while self._inbox:
                    self._inbox.popleft()()
                self._expire_due()
        finally:
            self._close_all()

    def _drain_wakeups(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def _readable(self, connection: InboundConnection) -> None:
        while True:
            try:
                request = connection.read()
            except Gone:
                self._drop(connection, None)
                return
            except FrameError as e:
                self._drop(connection, e)
                return
            if request is None:
                if connection.pending():
                    continue
                return
            self._start(connection, request)
            if not connection.pending():
                return

    def _start(self, connection: InboundConnection, request: Request) -> None:
        self._on_call(connection, True)
        try:
            answers = self._serve(connection, request)
        except Exception as e:  # noqa: BLE001 - a refusal before the call's generator started
            self._answer_error(connection, e)
            return
        call = _Call(connection, answers)
        self._calls[connection] = call
        self._advance(call)

    def _advance(self, call: _Call) -> None:
        if call.ended:
            return
        call.park(None)
        try:
            for item in call.answers:
                if isinstance(item, Parked):
                    if item.done:
                        continue
                    call.park(item)
                    heapq.heappush(self._deadlines, _Deadline(item.deadline, next(self._order), item))
                    item.on_done(lambda _h, call=call: self._post(lambda: self._advance(call)))
                    return
                self._end(call)
                self._send(call.connection, item.frame())
                return
            raise RuntimeError("a data call ended without an answer")
        except Exception as e:  # noqa: BLE001 - answered with its status
            self._end(call)
            self._answer_error(call.connection, e)

    def _end(self, call: _Call) -> None:
        call.end()
        self._calls.pop(call.connection, None)
        self._on_call(call.connection, False)

    def _answer_error(self, connection: InboundConnection, error: BaseException) -> None:
        if connection.serving:  # refused before its call started
            connection.served()
            self._on_call(connection, False)
        code = status_of(error)
        if code is None:
            log.error(
                "data call of trainer %d failed with an unexpected %s; answered INTERNAL",
                connection.trainer_id,
                type(error).__name__,
                exc_info=error,
            )
            self._send(connection, [refusal(INTERNAL, f"internal error ({type(error).__name__}: {error})")])
            return
        self._send(connection, [refusal(code.value[0], str(error))])

    def _send(self, connection: InboundConnection, frame: Sequence) -> None:
        try:
            send_all(connection.sock, frame, self._send_timeout)
        except (OSError, TimeoutError) as e:
            self._drop(connection, e)

    def _expire_due(self) -> None:
        now = time.monotonic()
        while self._deadlines and self._deadlines[0].at <= now:
            handle = heapq.heappop(self._deadlines).handle
            if not handle.done:
                handle.expire()  # ends it: its callback queues the call, which answers the timeout

    def _drop(self, connection: InboundConnection, error: Optional[BaseException]) -> None:
        """Close ``connection``; a call it had parked is cancelled (its generator closed)."""
        if error is not None:
            log.info(
                "data connection of trainer %d from %s closed: %s",
                connection.trainer_id,
                connection.peer,
                error,
            )
        try:
            self._selector.unregister(connection.sock)
        except (KeyError, ValueError):
            pass
        call = self._calls.pop(connection, None)
        if call is not None:
            call.end()
            if call.parked is not None and not call.parked.done:
                call.parked.cancel()
            call.answers.close()
            self._on_call(connection, False)
        connection.close()

    def _close_all(self) -> None:
        for key in list(self._selector.get_map().values()):
            if key.data is not None:
                self._drop(key.data, None)
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()
