"""Who is alive now, decided once (pserver/engine/roster.py's ``heard_at``): a held call is no silence.

A trainer whose call a pserver holds (a sync push parked in the barrier, a
Reduce waiting for its round) counts as heard from now, both for the
heartbeat watchdog (``Engine.drop_silent``) and for a second process saying
Hello with its id (``Engine.presence``); the Reduce service tells the engine
who waits in it (``held_elsewhere``) and touches each trainer its round
releases (``released``), as the engine's own waits do.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from torch import nn

from pserver.engine import Reductions, SyncEngine
from pserver.engine.roster import Roster, heard_at
from pserver.errors import BarrierTimeout
from pserver.store import BlockStore
from pserver.tables.table_set import TableSet
from tests.helpers.servicer import wired_engine
from transpiler import DistributeTranspiler, DistributeTranspilerConfig, Program

EP = "127.0.0.1:1"
JOIN = 10.0  # seconds a test thread may take at most


HEARD_AT = [
    # case, last_seen, held, trainer, now, expected
    ("heard from at its last call", {0: 40.0}, set(), 0, 100.0, 40.0),
    ("never heard from", {}, set(), 0, 100.0, None),
    ("held: heard from now, however long ago it called", {0: 40.0}, {0}, 0, 100.0, 100.0),
    ("held and never noted", {}, {0}, 0, 100.0, 100.0),
    ("another trainer's held call is not its own", {0: 40.0}, {1}, 0, 100.0, 40.0),
]


@pytest.mark.parametrize(
    "case, last_seen, held, trainer, now, expected", HEARD_AT, ids=[r[0] for r in HEARD_AT]
)
def test_heard_at(case, last_seen, held, trainer, now, expected):
    assert heard_at(trainer, last_seen, held, now) == expected


SILENT = [
    # case, last_seen, held, closed, dropped, expected (timeout 30 s, now 100)
    ("heard within the timeout", {0: 80.0, 1: 71.0}, set(), set(), set(), []),
    ("silent past the timeout", {0: 80.0, 1: 60.0}, set(), set(), set(), [(1, 40.0)]),
    ("silent but held", {0: 80.0, 1: 60.0}, {1}, set(), set(), []),
    ("exactly the timeout is not past it", {0: 70.0}, set(), set(), set(), []),
    ("closed or already dropped: not live", {0: 10.0, 1: 10.0, 2: 10.0}, set(), {0}, {1}, [(2, 90.0)]),
    ("two silent, by id", {2: 50.0, 1: 20.0}, set(), set(), set(), [(1, 80.0), (2, 50.0)]),
]


@pytest.mark.parametrize(
    "case, last_seen, held, closed, dropped, expected", SILENT, ids=[r[0] for r in SILENT]
)
def test_roster_silent(case, last_seen, held, closed, dropped, expected):
    r = Roster(3)
    for t in (0, 1, 2):
        r.join(t)
    r.last_seen = dict(last_seen)  # one not in it was never heard from
    r.closed, r.dropped = set(closed), set(dropped)
    assert r.silent(30.0, held, now=100.0) == expected
    assert r.drop_silent(30.0, held, now=100.0) == expected
    assert all(r.dropped_at[t] == 100.0 and t in r.dropped for t, _ in expected)
    for t in (0, 1, 2):
        assert r.presence(t, held, 100.0) == (
            heard_at(t, r.last_seen, held, 100.0),
            t in r.closed | r.dropped,
        )


def wired(trainers: int, barrier_timeout: float = JOIN):
    """(engine, Reduce service) wired as ParameterServer wires them (pserver/server.py)."""
    return wired_engine(trainers, barrier_timeout)


def reduce_in_thread(svc: Reductions, trainer_id: int, value: float) -> dict:
    out: dict = {}

    def run():
        try:
            out["answer"] = svc.reduce(trainer_id, "loss", 0, "sum", {"v": np.array([value])})
        except Exception as e:  # noqa: BLE001 - the test looks at it
            out["error"] = e

    out["thread"] = threading.Thread(target=run, daemon=True)
    out["thread"].start()
    return out


def parked(svc: Reductions, trainers: set) -> None:
    deadline = time.monotonic() + JOIN
    while svc.parked_trainers() != trainers:
        assert time.monotonic() < deadline, f"never parked: {trainers}"
        time.sleep(0.001)


def test_a_trainer_waiting_in_a_reduce_round_is_alive_and_heard_from_when_the_round_ends():
    engine, svc = wired(3)
    waiting = reduce_in_thread(svc, 0, 1.0)
    parked(svc, {0})
    engine.roster.last_seen[0] -= 60  # its Reduce arrived a minute ago and still waits
    engine.roster.last_seen[1] -= 60  # trainer 1 called then, and holds no call here
    assert engine.held() == {0}
    assert engine.presence(0)[0] > time.monotonic() - 5  # a takeover's Hello finds the id's holder alive
    assert engine.presence(1)[0] < time.monotonic() - 59
    assert engine.drop_silent(timeout=30) == [1]  # trainer 0 is held, not silent
    assert svc.reduce(2, "loss", 0, "sum", {"v": np.array([2.0])})[1] == (0, 2)
    waiting["thread"].join(JOIN)
    assert "error" not in waiting and waiting["answer"][0]["v"].tolist() == [3.0]
    # Released just now: heard from at the round's end, not at its call a minute ago.
    assert engine.held() == set() and engine.presence(0)[0] > time.monotonic() - 5
    assert engine.drop_silent(timeout=30) == []


def test_a_reduce_that_fails_is_not_a_sign_of_life():
    engine, svc = wired(2, barrier_timeout=0.05)
    engine.roster.last_seen[0] -= 60
    with pytest.raises(BarrierTimeout, match="still waits for trainers \\[1\\]"):
        svc.reduce(0, "loss", 0, "sum", {"v": np.array([1.0])})
    assert engine.presence(0)[0] < time.monotonic() - 59


def test_held_elsewhere_is_asked_outside_the_engines_lock():
    """The Reduce service asks the engine whom it expects holding its own lock: the engine must not hold
    its own while it asks the service who waits there (each would wait for the other)."""
    asked = []

    def elsewhere():
        asked.append(engine.cv._is_owned())
        return {1}

    t = DistributeTranspiler(DistributeTranspilerConfig())
    t.transpile(0, program=Program(nn.Linear(4, 2), "sgd", lr=0.5), pservers=EP, trainers=2)
    ps = t.get_pserver_program(EP)
    engine = SyncEngine(
        BlockStore(ps, t.get_startup_program(EP, ps)),
        TableSet(ps),
        2,
        EP,
        barrier_timeout=5.0,
        held_elsewhere=elsewhere,
    )
    engine.hello(0)
    engine.hello(1)
    engine.roster.last_seen[0] -= 60
    engine.roster.last_seen[1] -= 60
    assert engine.drop_silent(timeout=30) == [0]
    assert engine.presence(1)[0] > time.monotonic() - 5
    assert asked == [False, False]
