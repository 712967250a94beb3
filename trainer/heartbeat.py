"""A trainer's heartbeat: a background thread telling every pserver it is alive."""
from __future__ import annotations

import logging
import threading
from typing import Sequence

from .errors import FencedError, PserverError
from .transport import Channels

log = logging.getLogger(__name__)


class Heartbeat:
    """Sends ``Heartbeat`` to each pserver every ``interval`` s until :meth:`stop`.

    Pservers drop a trainer silent for ``heartbeat_timeout`` from their
    barriers; this keeps a trainer that is busy (a long forward, a data
    stall) or waiting in a barrier counted. Failures are logged at debug
    level only: the training calls report unreachable pservers.
    """

    def __init__(self, channels: Channels, endpoints: Sequence[str], interval: float):
        self._channels = channels
        self._endpoints = list(endpoints)
        self._interval = interval
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"trainer-{channels.trainer_id}-heartbeat")

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            for ep in self._endpoints:
                if self._stopped.is_set():
                    return
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

    def stop(self) -> None:
        """Stop sending; returns once the thread has finished its current call."""
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self._interval + 1.0)
