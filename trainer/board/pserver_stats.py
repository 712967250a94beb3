"""What trainer 0 writes of each pserver: its Stats as scalars, asked on one background thread.

:class:`StatsPoller` runs in trainer 0's first process only. Every
``tensorboard_every`` steps the board asks it for a round: one Stats call to
every pserver at once, each with a deadline (:data:`STATS_TIMEOUT`), on the
poller's own thread, so a step never waits for it. A round asked for while
the last one still runs is dropped (counted in :attr:`StatsPoller.dropped`):
never more than one call per pserver in flight, never a queue. A pserver that
does not answer is logged once until it answers again, and its scalars are
left out of that round. :func:`pserver_scalars` turns one reply into tags.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Dict, List, Mapping, Optional, Union

from psproto import ps_pb2

from ..errors import PserverError

log = logging.getLogger(__name__)

# The deadline of one Stats call: the pserver answers from counters, so a slow answer means trouble.
STATS_TIMEOUT = 5.0

Reply = Union[ps_pb2.StatsReply, PserverError]
AskStats = Callable[[float], Mapping[str, Reply]]  # every pserver's reply, by endpoint
WriteScalars = Callable[[Dict[str, float], int], None]  # (tags and values, step)


def pserver_scalars(
    index: int, reply: ps_pb2.StatsReply, previous: Optional[ps_pb2.StatsReply] = None
) -> Dict[str, float]:
    """The tags of pserver ``index`` from its ``reply`` (``previous``: its last one, for the push rate).

    ``applied_step`` is the pserver's step (updates applied); pushes a second
    are measured between two replies of the same process (the pserver's own
    uptime clock), else averaged since it started; per distributed table, the
    rows in memory and on disk and the rows evicted since the pserver started;
    with hot standby, the messages the backup has not acknowledged yet.
    """
    prefix = f"pserver{index}/"
    out = {prefix + "applied_step": float(reply.step)}
    if (
        previous is not None
        and previous.incarnation == reply.incarnation
        and reply.uptime_s > previous.uptime_s
    ):
        out[prefix + "pushes_per_s"] = max(0, reply.pushes - previous.pushes) / (
            reply.uptime_s - previous.uptime_s
        )
    elif reply.uptime_s > 0:
        out[prefix + "pushes_per_s"] = reply.pushes / reply.uptime_s
    for table in reply.tables:
        out[f"{prefix}rows_in_memory/{table.table}"] = float(table.rows - table.disk_rows)
        out[f"{prefix}rows_on_disk/{table.table}"] = float(table.disk_rows)
        out[f"{prefix}evictions/{table.table}"] = float(table.evicted)
    if reply.HasField("replica"):
        out[prefix + "replication_lag"] = float(reply.replica.lag)
    return out


class StatsPoller:
    """Stats rounds over ``endpoints`` (pserver k is ``endpoints[k]``), written by ``write`` at the step
    asked for."""

    def __init__(
        self, ask: AskStats, endpoints: List[str], write: WriteScalars, timeout: float = STATS_TIMEOUT
    ):
        self._ask = ask
        self._endpoints = list(endpoints)
        self._write = write
        self._timeout = timeout
        self._previous: Dict[str, ps_pb2.StatsReply] = {}
        self._failing: Dict[str, bool] = {}
        self._cv = threading.Condition()
        self._asked: Optional[int] = None  # the step of the round asked for, not started yet
        self._running = False
        self._stopped = False
        self.last_step: Optional[int] = None  # the step of the last round written
        self.dropped = 0
        self._thread = threading.Thread(target=self._loop, name="trainer-board-stats", daemon=True)
        self._thread.start()

    def request(self, step: int) -> None:
        """Ask for a round at ``step``; dropped if one is asked for or running (returns at once)."""
        with self._cv:
            if self._stopped:
                return
            if self._running or self._asked is not None:
                self.dropped += 1
                return
            self._asked = step
            self._cv.notify()

    def final(self, step: int) -> None:
        """The last round, at ``step``, on the caller's thread (after the background one ended), unless
        written already."""
        self.stop()
        if self.last_step != step:
            self._round(step)

    def stop(self) -> None:
        """End the background thread; a round it runs finishes first (within its deadlines)."""
        with self._cv:
            self._stopped = True
            self._asked = None
            self._cv.notify()
        self._thread.join(self._timeout + 2.0)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while self._asked is None and not self._stopped:
                    self._cv.wait()
                if self._stopped:
                    return
                step, self._asked, self._running = self._asked, None, True
            try:
                self._round(step)
            except Exception:  # noqa: BLE001 - an observer's failure must not end training; it is logged
                log.exception("TensorBoard: a pserver Stats round failed")
            finally:
                with self._cv:
                    self._running = False

    def _round(self, step: int) -> None:
        """One Stats call to every pserver; the answers written at ``step``."""
        replies = self._ask(self._timeout)
        scalars: Dict[str, float] = {}
        for index, ep in enumerate(self._endpoints):
            reply = replies.get(ep)
            if not isinstance(reply, ps_pb2.StatsReply):
                if not self._failing.get(ep):
                    log.warning(
                        "TensorBoard: no Stats from pserver %s (%s); its scalars are skipped until it "
                        "answers",
                        ep,
                        reply,
                    )
                self._failing[ep] = True
                continue
            if self._failing.pop(ep, False):
                log.info("TensorBoard: pserver %s answers Stats again", ep)
            scalars.update(pserver_scalars(index, reply, self._previous.get(ep)))
            self._previous[ep] = reply
        if scalars:
            self._write(scalars, step)
        self.last_step = step
