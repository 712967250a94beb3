"""The Reduce service on its own: rounds over the trainers a roster expects, woken when the roster changes.

Part one drives :class:`Reductions` with a roster of plain sets; part two
wires it to a real sync engine as :class:`~pserver.ParameterServer` does, so
a trainer that closes or is dropped lets a pending round finish. The pure
bookkeeping (:class:`Rounds`, ``combine``, ``to_values``) is table-driven in
tests/pserver/test_metrics.py.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from pserver.engine import Reductions
from pserver.engine.services.reductions import MAX_OPEN
from pserver.errors import BarrierTimeout, MustResync, NotAllowed, ShuttingDown
from tests.helpers.servicer import wired_engine

EP = "127.0.0.1:1"
JOIN = 10.0  # seconds a test thread may take at most; the rounds below finish in milliseconds

V = lambda *xs: {"v": np.array(xs, dtype=np.float64)}  # noqa: E731


class Roster:
    """The two callables the service takes, over plain sets: who is expected, who may take part."""

    def __init__(self, trainers: int):
        self.expected = set(range(trainers))
        self.closed: set = set()

    def admit(self, trainer_id: int) -> None:
        if trainer_id in self.closed:
            raise NotAllowed(f"trainer {trainer_id} has closed")


def service(roster: Roster, barrier_timeout: float = 5.0) -> Reductions:
    return Reductions(EP, barrier_timeout, expected=lambda: set(roster.expected), admit=roster.admit)


class Call(threading.Thread):
    """One trainer's reduce in a thread of its own: its answer or its refusal."""

    def __init__(self, svc: Reductions, trainer_id: int, key: str, round_: int, op: str, values):
        super().__init__(daemon=True)
        self.args_ = (trainer_id, key, round_, op, values)
        self.svc, self.answer, self.error = svc, None, None
        self.start()

    def run(self):
        try:
            self.answer = self.svc.reduce(*self.args_)
        except Exception as e:  # noqa: BLE001 - the test looks at it
            self.error = e

    def result(self):
        self.join(JOIN)
        assert not self.is_alive(), "the reduce did not return"
        if self.error is not None:
            raise self.error
        return self.answer


def waiting(svc: Reductions, key: str, round_: int) -> None:
    """Block until ``(key, round_)`` is open (a caller waits in it)."""
    deadline = time.monotonic() + JOIN
    while (key, round_) not in svc.open_rounds():
        assert time.monotonic() < deadline, f"round {round_} of {key!r} never opened"
        time.sleep(0.001)


# -- the service over a roster of sets ---------------------------------------------------------


def test_every_trainer_gets_the_same_float64_sum_in_ascending_trainer_order():
    roster = Roster(3)
    svc = service(roster)
    values = {0: V(1e16, 1.0), 1: V(-1e16, 2.0), 2: V(1.0, 3.0)}
    # Arrival order 2, 1, 0 would give (1 - 1e16) + 1e16 = 0 in float64; ascending order, (1e16 - 1e16) + 1 =
    # 1.
    calls = []
    for t in (2, 1):
        calls.append(Call(svc, t, "loss", 0, "sum", values[t]))
        waiting(svc, "loss", 0)
    calls.append(Call(svc, 0, "loss", 0, "sum", values[0]))
    answers = [c.result() for c in calls]
    for combined, trainers in answers:
        assert trainers == (0, 1, 2)
        assert combined["v"].dtype == np.float64 and combined["v"].tolist() == [1.0, 6.0]
    assert svc.open_rounds() == []
    # The latest round is kept: a retry of it is answered again, without waiting.
    again, trainers = svc.reduce(1, "loss", 0, "sum", values[1])
    assert again["v"].tolist() == [1.0, 6.0] and trainers == (0, 1, 2)


@pytest.mark.parametrize("op, expected", [("max", [4.0, 2.0]), ("min", [0.5, -5.0])])
def test_max_and_min(op, expected):
    roster = Roster(2)
    svc = service(roster)
    first = Call(svc, 1, "k", 0, op, V(0.5, 2.0))
    waiting(svc, "k", 0)
    assert svc.reduce(0, "k", 0, op, V(4.0, -5.0))[0]["v"].tolist() == expected
    assert first.result()[0]["v"].tolist() == expected


def test_a_pending_round_finishes_when_the_roster_no_longer_expects_the_missing_trainer():
    roster = Roster(3)
    svc = service(roster)
    calls = [Call(svc, t, "k", 0, "sum", V(t + 1.0)) for t in (0, 1)]
    waiting(svc, "k", 0)
    time.sleep(0.05)
    assert all(c.is_alive() for c in calls)  # waiting for trainer 2
    roster.expected.discard(2)
    svc.roster_changed()
    for c in calls:
        combined, trainers = c.result()
        assert combined["v"].tolist() == [3.0] and trainers == (0, 1)


def test_a_missing_trainer_is_named_after_barrier_timeout_and_the_callers_values_leave_the_round():
    roster = Roster(3)
    svc = service(roster, barrier_timeout=0.2)
    started = time.monotonic()
    with pytest.raises(
        BarrierTimeout,
        match=r"pserver 127.0.0.1:1: round 4 of reduction 'k' still waits for "
        r"trainers \[1, 2\] after 0.2s",
    ):
        svc.reduce(0, "k", 4, "sum", V(1.0))
    assert time.monotonic() - started >= 0.2
    assert svc.open_rounds() == []


def test_a_trainer_the_roster_refuses_opens_nothing():
    roster = Roster(2)
    roster.closed.add(1)
    svc = service(roster)
    with pytest.raises(NotAllowed, match="trainer 1 has closed"):
        svc.reduce(1, "k", 0, "sum", V(1.0))
    assert svc.open_rounds() == []


def test_open_rounds_are_bounded():
    roster = Roster(2)  # trainer 1 never comes: every round stays open
    svc = service(roster, barrier_timeout=JOIN)
    calls = [Call(svc, 0, f"k{i:02d}", 0, "sum", V(1.0)) for i in range(MAX_OPEN)]
    for i in range(MAX_OPEN):
        waiting(svc, f"k{i:02d}", 0)
    with pytest.raises(NotAllowed, match=f"{MAX_OPEN} reductions are open already"):
        svc.reduce(0, "one-more", 0, "sum", V(1.0))
    svc.stop()
    for c in calls:
        with pytest.raises(ShuttingDown):
            c.result()


def test_stop_refuses_the_pending_rounds_and_the_later_ones():
    roster = Roster(2)
    svc = service(roster)
    pending = Call(svc, 0, "k", 0, "sum", V(1.0))
    waiting(svc, "k", 0)
    svc.stop()
    with pytest.raises(ShuttingDown, match="pserver 127.0.0.1:1 is shutting down"):
        pending.result()
    assert svc.open_rounds() == []
    with pytest.raises(ShuttingDown):
        svc.reduce(1, "k", 1, "sum", V(1.0))


# -- wired to a sync engine, as the server wires it --------------------------------------------


def wired(trainers: int, barrier_timeout: float = JOIN):
    """(engine, service) as ParameterServer builds them: the engine tells the service of roster changes."""
    return wired_engine(trainers, barrier_timeout)


def test_a_round_finishes_when_the_engine_drops_the_silent_trainer():
    engine, svc = wired(3)
    calls = [Call(svc, t, "auc", 0, "sum", V(t + 1.0, 10.0)) for t in (0, 2)]
    waiting(svc, "auc", 0)
    time.sleep(0.05)
    assert all(c.is_alive() for c in calls)  # waiting for trainer 1
    engine.roster.last_seen[1] -= 60
    assert engine.drop_silent(timeout=30) == [1]
    for c in calls:
        combined, trainers = c.result()
        assert combined["v"].tolist() == [4.0, 20.0] and trainers == (0, 2)
    with pytest.raises(MustResync, match="trainer 1 was dropped"):
        svc.reduce(1, "auc", 1, "sum", V(1.0, 1.0))  # until it says Hello again
    assert svc.open_rounds() == []


def test_a_round_finishes_when_the_missing_trainer_closes():
    engine, svc = wired(2)
    pending = Call(svc, 1, "loss", 0, "max", V(7.0))
    waiting(svc, "loss", 0)
    assert engine.close(0) == 1
    combined, trainers = pending.result()
    assert combined["v"].tolist() == [7.0] and trainers == (1,)
    with pytest.raises(NotAllowed, match="trainer 0 has closed"):
        svc.reduce(0, "loss", 1, "max", V(1.0))


def test_a_wired_round_waits_while_the_engine_holds_its_lock_and_ends_after():
    """A long update (or checkpoint) holding the engine's lock delays a round; it does not deadlock it."""
    engine, svc = wired(2)
    pending = Call(svc, 0, "k", 0, "sum", V(1.0))
    waiting(svc, "k", 0)
    with engine.cv:
        other = Call(svc, 1, "k", 0, "sum", V(2.0))
        time.sleep(0.05)
        assert other.is_alive()  # its check of the roster needs the engine's lock
    assert other.result()[0]["v"].tolist() == [3.0] and pending.result()[1] == (0, 1)
    grads = {n: torch.zeros_like(b) for n, b in engine.store.blocks.items()}
    engine.push(0, 0, grads)  # the engine is unaffected
    engine.push(1, 0, grads)
    assert engine.step == 1
