"""The park/resolve rules of pserver.engine.waits, without a server: each case is a sequence of events.

A parked wait holds no thread; whoever changes the state calls notify() under
the lock and every wait that is over ends there: done when its condition
holds, ShuttingDown after stop(), MustResync after a roll-back, BarrierTimeout
naming who is missing once the waiter expires it at its deadline. A waiter
that goes away cancels its handle, and nothing keeps it.
"""

import threading
from types import SimpleNamespace

import pytest

from pserver.engine.waits import Waits
from pserver.errors import BarrierTimeout, MustResync, Refusal, ShuttingDown

EP = "127.0.0.1:1"


def setup(timeout: float = 5.0):
    state = SimpleNamespace(step=0, missing=[2, 5])
    rollbacks = SimpleNamespace(made=0, restored_from=3)
    waits = Waits(threading.Condition(), EP, timeout, rollbacks)
    return state, rollbacks, waits


def park(waits, state, target=1, measured=True):
    with waits.cv:
        handle = waits.park(lambda: state.step >= target, "step 0", lambda: list(state.missing), measured)
        ended = []
        handle.add_callback(lambda h: ended.append(h.error))
    return handle, ended


# (name, events, expected error type or None for completed, still parked afterwards)
CASES = [
    ("ready when parked", ["ready"], None, 0),
    ("parked until notified", ["apply", "notify"], None, 0),
    ("a notify without the state does nothing", ["notify"], "pending", 1),
    ("stop ends it", ["stop"], ShuttingDown, 0),
    ("a roll-back ends it at the next notify", ["rollback", "notify"], MustResync, 0),
    ("the deadline names the missing", ["expire"], BarrierTimeout, 0),
    ("expired once ready: completed, not timed out", ["apply", "expire"], None, 0),
    ("ready wins over stop", ["apply", "stop"], None, 0),
    ("a cancelled wait is forgotten", ["cancel"], Refusal, 0),
    ("cancel after completion changes nothing", ["apply", "notify", "cancel"], None, 0),
]


@pytest.mark.parametrize("name,events,expected,left", CASES, ids=[c[0] for c in CASES])
def test_park_rules(name, events, expected, left):
    state, rollbacks, waits = setup()
    if events[0] == "ready":
        state.step = 1
    handle, ended = park(waits, state)
    for event in events:
        with waits.cv:
            if event == "apply":
                state.step = 1
            elif event == "notify":
                waits.notify()
            elif event == "stop":
                waits.stop()
            elif event == "rollback":
                rollbacks.made += 1
            elif event == "expire":
                waits.expire(handle)
            elif event == "cancel":
                waits.cancel(handle)
    assert waits.parked == left
    if expected == "pending":
        assert not handle.done and ended == []
        return
    assert handle.done and len(ended) == 1  # callbacks run once, when it ends
    if expected is None:
        assert handle.error is None and ended == [None]
        handle.finish()
    else:
        assert type(handle.error) is expected
        with pytest.raises(expected):
            handle.finish()
    if expected is BarrierTimeout:
        assert str(handle.error) == f"pserver {EP}: step 0 still waits for trainers [2, 5] after 5s"
    if expected is MustResync:
        assert "rolled back to the checkpoint at step 3" in str(handle.error)


def test_a_callback_added_after_the_end_runs_at_once():
    state, _, waits = setup()
    state.step = 1
    handle, ended = park(waits, state)
    late = []
    handle.on_done(lambda h: late.append(h.error))
    assert ended == [None] and late == [None]


def test_one_notify_releases_every_parked_wait_once():
    state, _, waits = setup()
    handles = [park(waits, state) for _ in range(100)]
    assert waits.parked == 100
    with waits.cv:
        state.step = 1
        waits.notify()
        waits.notify()
    assert waits.parked == 0
    assert all(h.done and ended == [None] for h, ended in handles)


def test_a_wait_for_a_later_step_stays_parked():
    state, _, waits = setup()
    first, _ = park(waits, state, target=1)
    second, _ = park(waits, state, target=2)
    with waits.cv:
        state.step = 1
        waits.notify()
    assert first.done and not second.done and waits.parked == 1


def test_a_measured_wait_reports_its_seconds_and_an_immediate_one_does_not():
    state, _, waits = setup()
    waited = []
    waits.on_wait = waited.append
    parked, _ = park(waits, state)
    with waits.cv:
        state.step = 1
        waits.notify()
    parked.finish()
    immediate, _ = park(waits, state)
    immediate.finish()
    assert len(waited) == 1 and waited[0] >= 0


def test_the_blocking_wait_uses_the_same_handles():
    state, _, waits = setup()
    errors = []

    def waiter():
        with waits.cv:
            try:
                waits.wait(lambda: state.step >= 1, "step 0", lambda: [1])
            except Refusal as e:  # pragma: no cover - reported below
                errors.append(e)

    thread = threading.Thread(target=waiter)
    thread.start()
    with waits.cv:
        while waits.parked == 0:
            waits.cv.wait(0.01)
        state.step = 1
        waits.notify()
    thread.join(5)
    assert not thread.is_alive() and errors == [] and waits.parked == 0


def test_the_blocking_wait_times_out_naming_the_missing():
    state, _, waits = setup(timeout=0.05)
    with waits.cv, pytest.raises(BarrierTimeout, match=r"still waits for trainers \[7\] after 0.05s"):
        waits.wait(lambda: False, "step 0", lambda: [7])
    assert waits.parked == 0
