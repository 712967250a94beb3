"""Sessions: which process speaks for each trainer id.

A trainer process says ``Hello`` with its trainer id and its *incarnation*
(a random number per process) and gets an unguessable session token; every
other call it makes carries the token. The decisions are pure functions,
table-tested in ``tests/pserver/test_sessions.py``:

=================================================  ==============================================
at Hello, the trainer id's current session is ...   decision
=================================================  ==============================================
none (new id, or this pserver restarted)            OPEN a session
the asking process's own (same incarnation)         KEEP it: a re-sync, same token
another process's, heard from within the window     REFUSE: two processes share the id
another process's, silent longer, dropped, closed   TAKE_OVER: new session, the old one is fenced
=================================================  ==============================================

=================================================  ==============================================
a call carries ...                                  verdict
=================================================  ==============================================
the trainer id's current token                      OK
no token                                            NO_SESSION: refused, nothing changes
a token a newer process of the id replaced          FENCED: that old process must stop
any other token                                     UNKNOWN: Hello again (the pserver restarted)
=================================================  ==============================================

Sessions live in memory only: a restarted pserver has none, and every
trainer opens a new one when its re-sync says Hello. The alive window is
three heartbeat intervals (``DistributeTranspilerConfig.session_alive_window``).
"""

from __future__ import annotations

import collections
import hmac
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Dict, Optional

from ..errors import AlreadyRunning, Fenced, MustResync, NoSession

log = logging.getLogger(__name__)

OPEN, KEEP, REFUSE, TAKE_OVER = "open", "keep", "refuse", "take over"
OK, NO_SESSION, FENCED, UNKNOWN = "ok", "no session", "fenced", "unknown"

# Fenced tokens remembered per pserver: enough for every takeover a job sees;
# an older one reads as UNKNOWN, whose Hello is then refused or fenced again.
FENCED_KEPT = 1024


@dataclass(frozen=True)
class Session:
    """One process's hold on a trainer id: its token, its incarnation, where it called from, when."""

    token: str
    incarnation: int
    peer: str
    opened: float  # monotonic seconds


def on_hello(
    current: Optional[Session],
    incarnation: int,
    last_heard: Optional[float],
    ended: bool,
    now: float,
    alive_window: float,
) -> str:
    """What a Hello from process ``incarnation`` does to the id's ``current`` session (see the table).

    ``last_heard`` is when the id last called (monotonic; None if never),
    ``ended`` whether it closed or was dropped for silence. A session never
    heard from counts as heard from when it opened: its Hello is under way.
    """
    if current is None:
        return OPEN
    if current.incarnation == incarnation:
        return KEEP
    heard = current.opened if last_heard is None else last_heard
    if ended or now - heard > alive_window:
        return TAKE_OVER
    return REFUSE


def on_call(current: Optional[Session], token: str, fenced: bool) -> str:
    """The verdict on a call carrying ``token`` (``fenced``: a token a takeover replaced)."""
    if not token:
        return NO_SESSION
    # Bytes: compare_digest refuses str with non-ASCII characters, which any caller can send.
    if current is not None and hmac.compare_digest(current.token.encode(), token.encode()):
        return OK
    return FENCED if fenced else UNKNOWN


class Sessions:
    """The current session of every trainer id on one pserver, and the tokens fenced by takeovers."""

    def __init__(self, endpoint: str, alive_window: float):
        self.endpoint = endpoint
        self.alive_window = alive_window
        self._current: Dict[int, Session] = {}
        # token -> (trainer id, peer of the process that took over), oldest first.
        self._fenced: "collections.OrderedDict[str, tuple]" = collections.OrderedDict()
        self._lock = threading.Lock()

    def hello(
        self, trainer_id: int, incarnation: int, peer: str, last_heard: Optional[float], ended: bool
    ) -> str:
        """Open, keep or take over the session of ``trainer_id``; returns its token.

        Raises :class:`AlreadyRunning` naming the id and the live process's
        peer when another process holds a live session for it.
        """
        with self._lock:
            current = self._current.get(trainer_id)
            now = time.monotonic()
            decision = on_hello(current, incarnation, last_heard, ended, now, self.alive_window)
            if decision == KEEP:
                return current.token
            if decision == REFUSE:
                heard = current.opened if last_heard is None else last_heard
                raise AlreadyRunning(
                    f"pserver {self.endpoint}: trainer {trainer_id} is already running: its session was "
                    f"opened from {current.peer} and it was heard from {now - heard:.1f}s ago; this Hello "
                    f"came from {peer}. Two processes were started with trainer id {trainer_id} (check "
                    f"PADDLE_TRAINER_ID); a restarted trainer takes the id over once the old process has "
                    f"been silent for {self.alive_window:g}s"
                )
            session = Session(secrets.token_hex(16), incarnation, peer, now)
            self._current[trainer_id] = session
            if decision == TAKE_OVER:
                self._fenced[current.token] = (trainer_id, peer)
                while len(self._fenced) > FENCED_KEPT:
                    self._fenced.popitem(last=False)
                log.warning(
                    "%s: trainer %d: a new process (from %s) takes over from the one at %s; the old "
                    "session is fenced",
                    self.endpoint,
                    trainer_id,
                    peer,
                    current.peer,
                )
            return session.token

    def incarnation(self, trainer_id: int) -> Optional[int]:
        """The incarnation of the process holding ``trainer_id``'s session, None if none (lock-free: one
        dict read)."""
        current = self._current.get(trainer_id)
        return current.incarnation if current is not None else None

    def check(self, trainer_id: int, token: str) -> None:
        """Pass a call of ``trainer_id`` carrying ``token``, or refuse it (it then changes nothing).

        Lock-free on the way through: one dict read and a constant-time compare.
        """
        current = self._current.get(trainer_id)
        fenced = self._fenced.get(token)
        verdict = on_call(current, token, fenced is not None and fenced[0] == trainer_id)
        if verdict == OK:
            return
        if verdict == NO_SESSION:
            raise NoSession(
                f"pserver {self.endpoint}: a call for trainer {trainer_id} without a session; "
                f"only the process that said Hello for trainer {trainer_id} may speak for it, "
                f"with the session Hello returned"
            )
        if verdict == FENCED:
            raise Fenced(
                f"pserver {self.endpoint}: fenced: trainer {trainer_id} rejoined (a new process "
                f"from {fenced[1]} took the id over after this one went silent); this process must "
                f"stop instead of pushing stale gradients"
            )
        raise MustResync(
            f"pserver {self.endpoint}: trainer {trainer_id}'s session is not known here (this "
            f"pserver restarted since it was opened?); call Hello to open a new one"
        )


class Incarnation:
    """The number trainers tell this pserver's state by, in Hello, Heartbeat and Stats answers.

    A new value per process: trainers tell a restarted pserver by it. A
    replicated shard's processes answer with the state's lineage instead, the
    same on both, so a failover is no restart to trainers (:meth:`adopt`).
    """

    def __init__(self):
        self.value = secrets.randbits(63) or 1

    def adopt(self, lineage: int) -> None:
        """Answer ``lineage`` from now on (this process leads its replicated shard)."""
        self.value = lineage
