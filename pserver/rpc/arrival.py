"""Arrival: a trainer's call is a sign of life when it reaches the pserver, not when a handler thread takes
it.

Every trainer call names its process in its metadata (:data:`psproto.wire.TRAINER_METADATA`: ``<trainer
id>:<incarnation>``). The server's event loop hears of each call as it arrives and hands the caller to
``note``, which notes the trainer at once (the engine's lock-free ``touch``) if that process holds the id's
session: before the call waits for one of the pool's threads. Under a burst (a thousand trainers' pushes of
a step queued behind a few handler threads) a trainer whose push is queued is then not silent, and its
heartbeats, queued behind the same pushes, are not what keeps it in. A call of another process of the id (a
restarted trainer's Hello, a stray duplicate, a fenced one) is not noted: whether the id's holder is alive
is what a takeover decides by.

Only liveness rides on it: the session, the layout digest and every other check stay with the call itself.
A value that names no trainer of the job is ignored.

A call's end is heard too, and in between the trainer is not silent (:class:`CallsInProgress`): a sync push
released by its step still has its answer made and sent, and a thousand trainers' answers of one step take
a busy pserver longer than ``heartbeat_timeout``; its trainer cannot push the next step, nor has a reason
to heartbeat, before that answer reaches it. Likewise a heartbeat (or any unary call) waiting for a pool
thread behind a thousand async pushes: the trainer sends no second one while the first is in flight.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Dict, Iterator, Optional, Set, Tuple

import grpc

from psproto.wire import TRAINER_METADATA


def caller_of(metadata, trainers: int) -> Optional[Tuple[int, int]]:
    """(trainer id, incarnation) ``metadata`` names under TRAINER_METADATA, the id one of ``trainers``;
    else None."""
    for key, value in metadata or ():
        if key == TRAINER_METADATA:
            trainer, _, incarnation = str(value).partition(":")
            try:
                trainer_id, incarnation_ = int(trainer), int(incarnation)
            except ValueError:
                return None
            return (trainer_id, incarnation_) if 0 <= trainer_id < trainers else None
    return None


class ArrivalInterceptor(grpc.aio.ServerInterceptor):
    """Hands each arriving trainer call's (trainer id, incarnation) to ``note`` (after the token check)."""

    def __init__(self, note: Callable[[int, int], object], trainers: int):
        self._note = note
        self._trainers = trainers

    async def intercept_service(self, continuation, handler_call_details):
        """Note the caller the call names, if any; the call goes on unchanged."""
        caller = caller_of(handler_call_details.invocation_metadata, self._trainers)
        if caller is not None:
            self._note(*caller)
        return await continuation(handler_call_details)


class CallsInProgress:
    """Trainers with a call this pserver is serving (taken up, not yet answered): not silent (see the
    module doc).

    ``note(trainer id, incarnation)``: what a call's end is handed to, as its arrival is (the pserver's
    ``_arrived``). ``holds(trainer id, incarnation)``: whether that process holds the id's session when the
    call starts; only its calls count (a second process's Hello must not pass for the holder's life, as on
    arrival). Bounded by the calls in progress: one count per trainer with any.
    """

    def __init__(
        self,
        note: Callable[[int, int], object],
        trainers: int,
        holds: Callable[[int, int], bool] = lambda trainer_id, incarnation: True,
    ):
        self._note = note
        self._trainers = trainers
        self._holds = holds
        self._lock = threading.Lock()
        self._count: Dict[int, int] = {}

    @contextlib.contextmanager
    def serving(self, metadata) -> Iterator[None]:
        """Around serving one call whose invocation ``metadata`` may name its trainer (else nothing is
        counted)."""
        caller = caller_of(metadata, self._trainers)
        if caller is None or not self._holds(*caller):
            yield
            return
        self.begin(caller[0])
        try:
            yield
        finally:
            self.end(*caller)

    def begin(self, trainer_id: int) -> None:
        """A call of ``trainer_id``'s session holder is being served from now (the data channel's: its
        session checked)."""
        with self._lock:
            self._count[trainer_id] = self._count.get(trainer_id, 0) + 1

    def end(self, trainer_id: int, incarnation: int) -> None:
        """That call ended: the trainer was heard from now."""
        with self._lock:
            left = self._count.pop(trainer_id) - 1
            if left:
                self._count[trainer_id] = left
        self._note(trainer_id, incarnation)

    def trainers(self) -> Set[int]:
        """The trainers with a call in progress now."""
        with self._lock:
            return set(self._count)
