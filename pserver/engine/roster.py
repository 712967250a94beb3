"""Roster: what a pserver knows about each trainer (joined, closed, dropped, progress); Joined: what a
Hello learns.

Not thread-safe: the engine holds its lock around every call.
"""

from __future__ import annotations

import time
from typing import AbstractSet, Dict, Iterable, List, Mapping, NamedTuple, Optional, Tuple

from transpiler.position import Position

from ..errors import MustResync, NotAllowed


def heard_at(
    trainer_id: int, last_seen: Mapping[int, float], held: AbstractSet[int], now: float
) -> Optional[float]:
    """When ``trainer_id`` was last heard from, as liveness counts it (monotonic seconds; None: never).

    ``now`` while a call of its is ``held`` (parked in a sync barrier, or in a
    Reduce round): the pserver holds that call, so the wait is no silence
    (``Engine.drop_silent``) and no sign that the id's holder died (a second
    process's Hello, ``Engine.presence``). Else the time of its last call.
    """
    return now if trainer_id in held else last_seen.get(trainer_id)


class Joined(NamedTuple):
    """What a trainer's Hello learns of this pserver, read under one hold of the engine's lock.

    One consistent view: read piecewise, a step completing in between would
    pair a start step with the applied steps of another moment, and a
    joining trainer could take pservers mid-step for stalled ones.
    """

    step: int  # where the trainer (re)starts (see Engine.hello)
    position: Position  # its data position as last pushed or checkpointed, (0, 0) if none
    applied_step: int  # steps applied (async: updates)
    others_in_step: int  # other trainers counted or awaited in the step in progress (async: 0)
    counted_step: int  # the trainer's last step counted here, -1 if none
    checkpoint_step: int  # the checkpoint this process started from or rolled back to, -1 if none


class Roster:
    """The trainers of one job as seen by one pserver.

    ``live`` trainers are those a sync barrier waits for: every id that has
    neither closed nor been dropped for silence. ``last_step`` is the last step
    of each trainer counted here, ``positions`` its data position after the
    last *applied* step (what a checkpoint saves and a rejoining trainer resumes at).
    """

    def __init__(self, trainers: int):
        self.trainers = trainers
        self.joined: set = set()
        self.closed: set = set()
        self.dropped: set = set()
        self.last_step: Dict[int, int] = {}
        self.positions: Dict[int, Position] = {}
        self.last_seen: Dict[int, float] = {}
        # When each dropped trainer was dropped (monotonic seconds).
        self.dropped_at: Dict[int, float] = {}

    def live(self) -> set:
        return set(range(self.trainers)) - self.closed - self.dropped

    def check_pusher(self, trainer_id: int, endpoint: str, pserver_step: int) -> None:
        """Refuse a trainer that has closed (NotAllowed) or was dropped (MustResync) until it says Hello
        again."""
        if trainer_id in self.closed:
            raise NotAllowed(
                f"pserver {endpoint}: trainer {trainer_id} has closed; call Hello to rejoin before pushing"
            )
        if trainer_id in self.dropped:
            raise MustResync(
                f"pserver {endpoint}: trainer {trainer_id} was dropped after "
                f"heartbeat_timeout at step {pserver_step}; call Hello to rejoin"
            )

    def touch(self, trainer_id: int) -> None:
        """Note a sign of life from ``trainer_id`` (any call it makes)."""
        self.last_seen[trainer_id] = time.monotonic()

    def join(self, trainer_id: int) -> str:
        """Register a Hello; returns how: "joined", "rejoined" or "" (already in)."""
        self.touch(trainer_id)
        how = ""
        if trainer_id in self.closed or trainer_id in self.dropped:
            how = "rejoined"
        elif trainer_id not in self.joined:
            how = "joined"
        self.closed.discard(trainer_id)
        self.dropped.discard(trainer_id)
        self.dropped_at.pop(trainer_id, None)
        self.joined.add(trainer_id)
        return how

    def heard_from(self, trainers: Iterable[int], now: float) -> None:
        """Count ``trainers`` as joined and just heard from (a backup that takes the lead expects them)."""
        for t in trainers:
            self.joined.add(t)
            self.last_seen[t] = now

    def drop(self, trainer_id: int, now: float) -> None:
        """Take ``trainer_id`` out of the live set for silence, noting when."""
        self.dropped.add(trainer_id)
        self.dropped_at[trainer_id] = now

    def close(self, trainer_id: int) -> None:
        """Mark ``trainer_id`` done: neither live nor dropped any more."""
        self.closed.add(trainer_id)
        self.dropped.discard(trainer_id)
        self.dropped_at.pop(trainer_id, None)

    def abandoned(self, timeout: float, now: float) -> List[Tuple[int, float]]:
        """Dropped trainers that have not rejoined ``timeout`` s after their drop: [(id, seconds since)]."""
        return sorted(
            (t, now - at) for t, at in self.dropped_at.items() if t in self.dropped and now - at > timeout
        )

    def silent(self, timeout: float, held: AbstractSet[int], now: float) -> List[Tuple[int, float]]:
        """Joined, live trainers not heard from (:func:`heard_at`) for over ``timeout`` s: [(id, seconds
        silent)].

        One never heard from is not silent: it has not called yet.
        """
        heard = {t: heard_at(t, self.last_seen, held, now) for t in self.joined & self.live()}
        return sorted((t, now - at) for t, at in heard.items() if at is not None and now - at > timeout)

    def drop_silent(self, timeout: float, held: AbstractSet[int], now: float) -> List[Tuple[int, float]]:
        """Drop the :meth:`silent` trainers (see :meth:`drop`); them, with the seconds each was silent."""
        silent = self.silent(timeout, held, now)
        for t, _ in silent:
            self.drop(t, now)
        return silent

    def presence(self, trainer_id: int, held: AbstractSet[int], now: float) -> Tuple[Optional[float], bool]:
        """(when ``trainer_id`` was last heard from, :func:`heard_at`; whether it closed or was dropped)."""
        return heard_at(trainer_id, self.last_seen, held, now), trainer_id in self.closed | self.dropped

    def to_meta(self) -> dict:
        """The roster as a checkpoint manifest stores it."""
        ids = sorted(set(self.last_step) | set(self.positions))
        return {
            "trainers": {
                str(t): {
                    "last_step": self.last_step.get(t, -1),
                    "position": list(self.positions.get(t, (0, 0))),
                }
                for t in ids
            },
            "closed": sorted(self.closed),
        }

    def follow(self, meta: dict) -> None:
        """Take progress and closed trainers from the primary's roster (hot standby), as they are."""
        self.last_step = {
            int(t): int(v["last_step"])
            for t, v in meta.get("trainers", {}).items()
            if int(v["last_step"]) >= 0
        }
        self.positions = {
            int(t): Position(int(v["position"][0]), int(v["position"][1]))
            for t, v in meta.get("trainers", {}).items()
        }
        self.closed = {int(t) for t in meta.get("closed", [])}

    def load_meta(self, meta: dict) -> None:
        """Take progress and closed trainers from a checkpoint; nobody is joined or dropped."""
        self.follow(meta)
        # A checkpoint in which every trainer had closed ends a finished run: a new
        # run continuing from it starts with everyone expected.
        if self.closed >= set(range(self.trainers)):
            self.closed = set()
        # Signs of life (last_seen) are not progress: a roll-back keeps them, for the sessions.
        self.joined, self.dropped, self.dropped_at = set(), set(), {}
