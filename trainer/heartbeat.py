"""A trainer's heartbeat: a background thread that tells a pserver this trainer lives when no call did.

Pservers drop a trainer silent for ``heartbeat_timeout``. Every call a pserver
notes as a sign of life on arrival (a push-pull by any path, a pull, a
prefetch, Hello, Reduce, Restore, Checkpoint, SaveTables, a heartbeat), and
it holds a parked call (a sync push in its barrier, a Reduce in its round)
without counting the wait as silence. Its :class:`~trainer.transport.PserverChannel`
keeps the same account (:class:`~trainer.transport.contact.Contact`: contact
while a call is in flight, and until its answer), so the thread heartbeats
only the pservers this trainer has been silent towards for a
``heartbeat_interval``: none in steady training, however long a step's
barrier takes; those it waits on while a data loader stalls or an evaluation
runs; and, on a node, those only the other local ranks reach (this thread, on
local rank 0, counts local rank 0's calls only: heartbeats that are not
strictly needed, never one missing).

Bounds: one thread per trainer (per node), at most :data:`CHECKS_PER_INTERVAL`
wake-ups an interval, at most one heartbeat per pserver an interval. A
pserver hears from the trainer at most ``interval * (1 + 1 / CHECKS_PER_INTERVAL)``
after its last contact, plus the time the heartbeats to other pservers take.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Dict, List, Mapping, Sequence

from .errors import FencedError, PserverError
from .transport import Channels

log = logging.getLogger(__name__)

# The thread looks at most this many times an interval: a heartbeat is at most 1/this of an interval late.
CHECKS_PER_INTERVAL = 10


def heartbeats_due(last_contact: Mapping[str, float], now: float, interval: float) -> List[str]:
    """The pservers to heartbeat at ``now``: those whose last contact (monotonic s) is ``interval`` s old or older."""
    return [ep for ep, at in last_contact.items() if now - at >= interval]


def next_check(last_contact: Mapping[str, float], now: float, interval: float) -> float:
    """Seconds to the earliest pserver's due time, at least ``interval / CHECKS_PER_INTERVAL``, at most ``interval``."""
    soonest = min((at + interval for at in last_contact.values()), default=now + interval)
    return min(interval, max(interval / CHECKS_PER_INTERVAL, soonest - now))


class Heartbeat:
    """Sends ``Heartbeat`` to each pserver silent for ``interval`` s until :meth:`stop` (see the module doc).

    A heartbeat's own start is contact (the pserver notes it on arrival);
    one that failed is not sent again before an interval. Failures are
    logged at debug level only: the training calls report unreachable pservers.
    """

    def __init__(self, channels: Channels, endpoints: Sequence[str], interval: float):
        self._channels = channels
        self._endpoints = list(endpoints)
        self._interval = interval
        self._tried: Dict[str, float] = {}  # when the thread last tried each pserver (monotonic s)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"trainer-{channels.trainer_id}-heartbeat")

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def _last_contact(self) -> Dict[str, float]:
        """Per pserver: its channel's last contact (now, while a call is in flight), or this thread's last try if later."""
        now = time.monotonic()
        return {ep: max(self._channels[ep].contact.last(now), self._tried.get(ep, float("-inf")))
                for ep in self._endpoints}

    def _run(self) -> None:
        while True:
            for ep in heartbeats_due(self._last_contact(), time.monotonic(), self._interval):
                if self._stopped.is_set():
                    return
                self._tried[ep] = time.monotonic()
                try:
                    self._channels[ep].heartbeat(timeout=self._interval)
                except FencedError as e:
                    # Another process runs as this trainer now; the next training call raises it too.
                    log.warning("trainer %d: heartbeats stop: %s", self._channels.trainer_id, e)
                    return
                except PserverError as e:
                    log.debug("trainer %d: heartbeat: %s", self._channels.trainer_id, e)
                except ValueError:  # the channel was closed under us by close()
                    return
            if self._stopped.wait(next_check(self._last_contact(), time.monotonic(), self._interval)):
                return

    def stop(self) -> None:
        """Stop sending; returns once the thread has finished its current call."""
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self._interval + 1.0)
