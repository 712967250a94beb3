"""StartedPushPull: a push-pull sent on a data connection, its answer not read yet.

A trainer pushing to several pservers sends each its request, then reads each answer, all on its own thread
(:meth:`trainer.steppers.transfers.Transfers.push_all`): the pservers work on the pushes at once, as with a
thread per pserver, without handing each call to another thread and back (a wake-up and a GIL hand-over
each way, a few hundred µs of a step on two cores). Ended by :meth:`StartedPushPull.finish` (read the answer)
or :meth:`StartedPushPull.abandon` (close the connection: an answer nobody reads must not be taken for the
next call's).
"""

from __future__ import annotations

import threading
from typing import Callable, Tuple

import numpy as np

from psproto.dataplane.frames import COUNTED

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

    def abandon(self) -> None:
        """End it unread: the connection is closed (a later answer on it would be read as another call's)."""
        if not self._ended:
            self._drop()
            self._end()

    def _end(self) -> None:
        self._ended = True
        self._busy.release()
