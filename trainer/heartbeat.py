"""A trainer's heartbeat: a background thread that tells a pserver this trainer lives when no call did.

Pservers drop a trainer silent for ``heartbeat_timeout``. Every call a pserver
notes as a sign of life on arrival (a push-pull by any path, a pull, a
prefetch, Hello, Reduce, Restore, Checkpoint, SaveTables, a heartbeat), and
it holds a call it parked or is still serving (a sync push in its barrier, a
Reduce in its round, an answer still being made) without counting the wait as
silence. Its :class:`~trainer.transport.PserverChannel` keeps the same
account (:class:`~trainer.transport.contact.Contact`: contact while a call is
in flight, and until its answer), so the thread heartbeats
only the pservers this trainer has been silent towards for a
``heartbeat_interval``: none in steady training, however long a step's
barrier takes; those it waits on while a data loader stalls or an evaluation
runs; and, on a node, those only the other local ranks reach (this thread, on
local rank 0, counts local rank 0's calls only: heartbeats that are not
strictly needed, never one missing).

The heartbeats to different pservers go out at once, each a blocking call on
one of its trainer's own call threads (:meth:`Channels.submit`: they idle
exactly while a heartbeat is due, and start none of their own; a gRPC future
would start a thread to poll its idle channel, each heartbeat, which hundreds
of trainers in one process could not afford), and this thread reads them
later. Each has the pserver's own patience (``heartbeat_timeout``) as its
deadline: one that is in flight is contact, so no second one follows it
while it waits. A pserver too busy to take calls up for a while thus finds
one heartbeat per trainer waiting, not one per trainer per interval, and a
slow pserver delays no other's. A heartbeat to a replicated shard follows
its new primary, as every call does.

Bounds: one thread per trainer (per node; or per process, for all the trainers
it runs), at most :data:`CHECKS_PER_INTERVAL`
wake-ups an interval, at most one heartbeat per pserver in flight (so at most
half of a trainer's call threads, which are two per pserver) and one
started per pserver an interval. A pserver hears from the trainer at most
``interval * (1 + 1 / CHECKS_PER_INTERVAL)`` after its last contact, plus the
time the pserver takes to take the heartbeat up.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent import futures
from typing import Dict, List, Mapping, Sequence, Tuple, TypeVar, Union

from .errors import FencedError
from .transport import Channels, PserverChannel

log = logging.getLogger(__name__)

# The thread looks at most this many times an interval: a heartbeat is at most 1/this of an interval late.
CHECKS_PER_INTERVAL = 10

K = TypeVar("K")  # what a contact is kept by: a pserver, or (trainer, pserver) in the thread
Key = Tuple[int, str]  # (index of a trainer's channels in the thread, pserver endpoint)


def heartbeats_due(last_contact: Mapping[K, float], now: float, interval: float) -> List[K]:
    """The pservers to heartbeat at ``now``: those whose last contact (monotonic s) is ``interval`` s old
    or older."""
    return [ep for ep, at in last_contact.items() if now - at >= interval]


def next_check(last_contact: Mapping[K, float], now: float, interval: float) -> float:
    """Seconds to the earliest pserver's due time, at least ``interval / CHECKS_PER_INTERVAL``, at most
    ``interval``."""
    soonest = min((at + interval for at in last_contact.values()), default=now + interval)
    return min(interval, max(interval / CHECKS_PER_INTERVAL, soonest - now))


class Heartbeat:
    """Sends ``Heartbeat`` to each pserver silent for ``interval`` s until :meth:`stop` (see the module doc).

    A heartbeat's own start is contact (the pserver notes it on arrival), and
    so is the time it is in flight, up to ``deadline`` s (the pserver's
    ``heartbeat_timeout``: past it, the pserver has dropped the trainer
    anyway); one that failed is not sent again before an interval. Failures
    are logged at debug level only: the training calls report unreachable
    pservers.

    ``channels``: a trainer's, or several trainers' of one process (the
    emulated fan-in's, which :meth:`add` each once it said Hello): one thread
    heartbeats them all, each on its own account; a fenced trainer's
    heartbeats stop, the others' go on, and the thread ends with the last.
    """

    def __init__(
        self,
        channels: Union[Channels, Sequence[Channels]],
        endpoints: Sequence[str],
        interval: float,
        deadline: float,
    ):
        self._endpoints = list(endpoints)
        self._lock = threading.Lock()  # guards the trainers, keys and lateness: other threads add to them
        self._trainers: List[Channels] = []
        self._keys: List[Key] = []
        for c in [channels] if isinstance(channels, Channels) else channels:
            self.add(c)
        self._interval = interval
        self._deadline = deadline
        self._tried: Dict[Key, float] = {}  # when the thread last tried each (trainer, pserver) (monotonic s)
        self._in_flight: Dict[Key, futures.Future] = {}  # the heartbeat sent to each, until read
        self._late: List[float] = []  # how late each heartbeat went out, if by more than an interval (s)
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._run,
            daemon=True,
            name="trainer-{}-heartbeat".format(
                self._trainers[0].trainer_id if len(self._trainers) == 1 else "s"
            ),
        )

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def add(self, channels: Channels) -> None:
        """Heartbeat ``channels``' pservers too, from now on (its trainer said Hello)."""
        with self._lock:
            self._trainers.append(channels)
            self._keys = self._keys + [(len(self._trainers) - 1, ep) for ep in self._endpoints]

    def _channel(self, key: Key) -> PserverChannel:
        return self._trainers[key[0]][key[1]]

    def _last_contact(self) -> Dict[Key, float]:
        """Per (trainer, pserver): its last contact (now, while a call is in flight), or this thread's
        later try."""
        now = time.monotonic()
        return {
            key: max(self._channel(key).contact.last(now), self._tried.get(key, float("-inf")))
            for key in self._keys
        }  # a snapshot: add() and _retire() replace the list, never change it

    def _retire(self, trainer: int) -> None:
        """No more heartbeats for the ``trainer``-th channels (fenced, or closed under us)."""
        with self._lock:
            self._keys = [key for key in self._keys if key[0] != trainer]

    def _run(self) -> None:
        while self._keys or not self._trainers:
            self._read_answers()
            keys = set(self._keys)
            contacts = self._last_contact()
            for key in heartbeats_due(contacts, time.monotonic(), self._interval):
                if self._stopped.is_set():
                    return
                if (
                    key in self._in_flight or key not in keys
                ):  # in flight: its contact covers it until answered
                    continue
                self._tried[key] = time.monotonic()
                try:
                    self._in_flight[key] = self._trainers[key[0]].submit(
                        functools.partial(self._beat, self._channel(key), contacts[key] + self._interval)
                    )
                except RuntimeError:  # its Channels were shut down under us by close()
                    self._retire(key[0])
            self._report_late()
            if self._stopped.wait(next_check(self._last_contact(), time.monotonic(), self._interval)):
                return

    def _beat(self, channel: PserverChannel, due: float):
        """One heartbeat, on a call thread of its trainer; notes how late it went out if by more than an
        interval. None was due before to a pserver never reached (``due`` -inf: a trainer that adopts a
        layout heartbeats it from before its join's Hello), so it is never late."""
        late = time.monotonic() - due
        if self._interval < late < float("inf"):
            with self._lock:
                self._late.append(late)
        return channel.heartbeat(timeout=self._deadline)

    def _report_late(self) -> None:
        """Warn once a round of the heartbeats that went out more than an interval late since the last."""
        with self._lock:
            late, self._late = self._late, []
        if late:
            log.warning(
                "%d heartbeat(s) went out more than heartbeat_interval (%.1f s) late, the latest by %.1f s: "
                "this process is short of CPU; pservers drop a trainer silent for heartbeat_timeout "
                "(%.1f s)",
                len(late),
                self._interval,
                max(late),
                self._deadline,
            )

    def _read_answers(self) -> None:
        """Read the heartbeats that ended; retire the trainers whose heartbeats must stop."""
        for key, sent in list(self._in_flight.items()):
            if not sent.done():
                continue
            del self._in_flight[key]
            trainer_id = self._trainers[key[0]].trainer_id
            error = None if sent.cancelled() else sent.exception()
            if sent.cancelled() or isinstance(error, ValueError):  # its Channels were closed under it
                self._retire(key[0])
            elif isinstance(error, FencedError):
                # Another process runs as this trainer now; the next training call raises it too.
                log.warning("trainer %d: heartbeats stop: %s", trainer_id, error)
                self._retire(key[0])
            elif error is not None:
                log.debug("trainer %d: heartbeat: %s", trainer_id, error)

    def stop(self) -> None:
        """Stop sending; returns once the thread has finished its current call."""
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self._interval + 1.0)
