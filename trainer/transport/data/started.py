"""A push-pull sent on a data connection, its answer read later: :class:`StartedPushPull` on the connection,
:class:`StartedPush` for the transport above it.

A trainer pushing to several pservers sends each its request, then reads each answer, all on the step's own
thread (:meth:`trainer.steppers.transfers.Transfers.push_all`): the pservers work on the pushes at once, as
with a thread per pserver, without handing each call to another thread and back (a wake-up and a GIL
hand-over each way). The answers are read as they arrive (:func:`answered_first`), not in a fixed order: a
pserver counts a call as heard until it answers, the trainer until it reads the answer (its heartbeat skips
a pserver with a call in flight), so an answer left unread while another pserver parks the step (a sync
barrier waiting for a straggler) would be silence to a pserver that answered long ago, and it drops the
trainer after ``heartbeat_timeout``.

A started push-pull ends with ``finish`` (its answer read) or ``abandon`` (its connection closed: an answer
nobody reads must not be taken for the next call's).

Reading an answer fails as :meth:`trainer.transport.tensor_calls.TensorCalls.push_pull` fails, with one
exception kept from it: a connection found broken (DOWN) is the case where that call tries again on a new
connection (and, with hot standby, follows the shard's primary), so here the push is made again by that
very call. A push made twice is counted once (the pserver acknowledges a retry of a step it counted without
counting it again).
"""

from __future__ import annotations

import select
import threading
import time
from typing import Callable, Mapping, Tuple, TypeVar

import numpy as np

from psproto.dataplane.frames import COUNTED

from ...errors import DOWN, PserverError
from ..contact import Contact
from ..status_codes import call_errors
from .data_channel import DataCallError, DataChannel


class StartedPushPull:
    """The push-pull in flight on ``channel``, holding its slot's ``busy`` lock until it ends; ``drop``
    closes the connection (the link's slot); ``read`` decodes the answer's payload; ``sent``: the tensor
    bytes it carried."""

    def __init__(
        self, channel: DataChannel, busy: threading.Lock, drop: Callable[[], None], read: Callable, sent: int
    ):
        self._drop = drop
        self._channel = channel
        self._busy = busy
        self._read: Callable[[np.ndarray], int] = read
        self._sent = sent
        self._ended = False

    def finish(self, timeout: float) -> Tuple[int, bool, int, int]:
        """Read the answer, as :meth:`.data_link.DataLink.push_pull` returns it: (the pserver's step, whether
        it counted, tensor bytes sent, tensor bytes received). A broken connection is closed and raised."""
        try:
            answer, payload = self._channel.receive(timeout)
            received = self._read(payload)
        except DataCallError:
            self._drop()
            raise
        finally:
            self._end()
        return answer.step, bool(answer.flags & COUNTED), self._sent, received

    def fileno(self) -> int:
        """The connection's descriptor, readable once the answer starts to arrive (-1: closed)."""
        return self._channel.fileno()

    def buffered(self) -> bool:
        """Whether part of the answer was already read off the socket (see :meth:`DataChannel.buffered`)."""
        return self._channel.buffered()

    def abandon(self) -> None:
        """End it unread: the connection is closed (a later answer on it would be read as another call's)."""
        if not self._ended:
            self._drop()
            self._end()

    def _end(self) -> None:
        self._ended = True
        self._busy.release()


class StartedPush:
    """The push-pull ``started`` to ``endpoint``: in flight for ``contact`` until it ends; ``what`` names it
    in errors; ``again()`` makes the whole call anew (the pserver's step); ``count(sent, received)`` adds its
    tensor bytes to the channel's."""

    def __init__(
        self,
        endpoint: str,
        started: StartedPushPull,
        contact: Contact,
        timeout: float,
        what: str,
        again: Callable[[], int],
        count: Callable[[int, int], None],
    ):
        self.endpoint = endpoint
        self.deadline = time.monotonic() + timeout  # the call's, from its start, however late it is read
        self._started = started
        self._contact = contact
        self._what = what
        self._again = again
        self._count = count

    def finish(self) -> int:
        """The answer read and landed: the pserver's step it reflects."""
        answered = False
        try:
            with call_errors(self.endpoint, self._what):
                pserver_step, _, sent, received = self._started.finish(self.deadline - time.monotonic())
            answered = True
        except PserverError as e:
            if e.kind != DOWN:
                raise
        finally:
            self._contact.end(answered)
        if not answered:
            return self._again()
        self._count(sent, received)
        return pserver_step

    def fileno(self) -> int:
        """The connection's descriptor, readable once the answer starts to arrive (-1: closed)."""
        return self._started.fileno()

    def buffered(self) -> bool:
        """Whether part of the answer was already read off the socket."""
        return self._started.buffered()

    def abandon(self) -> None:
        """End it unread (another pserver's push failed first): its connection is closed."""
        self._started.abandon()
        self._contact.end(False)


K = TypeVar("K")


def answered_first(calls: Mapping[K, StartedPush]) -> K:
    """The key of a call in ``calls`` whose answer has begun to arrive, waiting for one until the earliest
    call's deadline (then that call: its ``finish`` ends it as timed out). A closed connection counts as
    answered (its ``finish`` finds it broken). With one call left, that one: its ``finish`` waits for it."""
    if len(calls) == 1:
        return next(iter(calls))
    for key, call in calls.items():
        if call.fileno() < 0 or call.buffered():
            return key
    poll = select.poll()  # not select(): a process of emulated trainers holds more than 1,024 descriptors
    keys = {call.fileno(): key for key, call in calls.items()}
    for fd in keys:
        poll.register(fd, select.POLLIN | select.POLLPRI)
    earliest = min(calls, key=lambda k: calls[k].deadline)
    while True:
        left = calls[earliest].deadline - time.monotonic()
        if left <= 0:
            return earliest
        ready = poll.poll(left * 1000.0)  # retried by Python itself when a signal interrupts it (PEP 475)
        if ready:
            return keys[ready[0][0]]
