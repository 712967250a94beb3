"""LanePushes: a push split across lanes is made whole once, and every lane's call learns what became of it.

Without a server: lanes are added as their calls would add them, and the
tickets say which call pushes the whole, which waits, and what each answers.
Buffers handed in are released exactly once, whatever happens.
"""

import threading
from types import SimpleNamespace

import pytest

from pserver.engine.waits import Waits
from pserver.errors import BadRequest, BarrierTimeout, MustResync, Refusal
from pserver.rpc.lane_pushes import LanePushes, merge

BLOCKS = {"w.block0": 800, "w.block1": 800, "b.block0": 8}


class Released:
    """A release callback that remembers what it released, and refuses a second release of the same
    buffers."""

    def __init__(self):
        self.seen = []

    def __call__(self, buffers):
        assert not any(b is buffers for b in self.seen), "buffers released twice"
        self.seen.append(buffers)


def lanes(timeout: float = 5.0):
    released = Released()
    return LanePushes(Waits(threading.Condition(), "127.0.0.1:1", timeout), released, BLOCKS), released


def grads(*names):
    return {n: f"grad of {n}" for n in names}, {}


def test_blocks_are_dealt_to_lanes_by_bytes():
    pushes, _ = lanes()
    assert pushes.lane_of(2) == {"w.block0": 0, "w.block1": 1, "b.block0": 0}
    assert pushes.blocks_of(0, 2) == ["w.block0", "b.block0"]
    assert pushes.blocks_of(1, 2) == ["w.block1"]


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_the_last_lane_pushes_the_whole_and_the_first_learns_it(order):
    pushes, released = lanes()
    parts = {0: grads("w.block0", "b.block0"), 1: grads("w.block1")}
    buffers = {k: {"lane": k} for k in parts}
    first = pushes.add(3, 7, order[0], 2, parts[order[0]], buffers[order[0]])
    assert first.whole is None and not first.wait.done
    last = pushes.add(3, 7, order[1], 2, parts[order[1]], buffers[order[1]])
    assert last.whole == (
        {"w.block0": "grad of w.block0", "b.block0": "grad of b.block0", "w.block1": "grad of w.block1"},
        {},
    )
    assert released.seen == []  # held until the engine is done with them
    pushes.finish(last.push, counted=True)
    assert first.wait.done and first.wait.error is None
    assert pushes.outcome(first) is True
    assert sorted(b["lane"] for b in released.seen) == [0, 1]
    assert pushes.held() == 0


def test_a_retried_attempt_is_made_whole_again_for_the_engine_to_judge():
    # The engine says whether it is a duplicate; after a roll-back the same step counts anew.
    pushes, released = lanes()
    pushes.add(3, 7, 0, 2, grads("w.block0"), {"a": 0})
    whole = pushes.add(3, 7, 1, 2, grads("w.block1"), {"a": 1})
    pushes.finish(whole.push, counted=True)
    waiting = pushes.add(3, 7, 1, 2, grads("w.block1"), {"retry": 1})
    assert waiting.whole is None and not waiting.wait.done
    again = pushes.add(3, 7, 0, 2, grads("w.block0"), {"retry": 0})
    assert again.whole is not None and again.push is not whole.push
    pushes.finish(again.push, counted=False)
    assert pushes.outcome(waiting) is False
    assert len(released.seen) == 4


def test_a_lane_of_an_older_step_starts_that_step_again():
    # A roll-back sends trainers back to an older step: its pushes must reach the engine again.
    pushes, released = lanes()
    first = pushes.add(3, 8, 0, 2, grads("w.block0"), {"step": 8})
    old = pushes.add(3, 5, 0, 2, grads("w.block0"), {"step": 5})
    assert first.wait.done and not old.wait.done
    with pytest.raises(Refusal, match="replaced by another attempt"):
        pushes.outcome(first)
    assert released.seen == [{"step": 8}]
    assert pushes.add(3, 5, 1, 2, grads("w.block1"), {"step": 5}).whole is not None


def test_a_lane_arriving_while_the_engine_has_the_push_starts_another_attempt():
    pushes, released = lanes()
    pushes.add(3, 7, 0, 2, grads("w.block0"), {"a": 0})
    taken = pushes.add(3, 7, 1, 2, grads("w.block1"), {"a": 1})
    retry = pushes.add(3, 7, 0, 2, grads("w.block0"), {"retry": 0})
    assert not retry.wait.done and released.seen == []  # the engine still has the first attempt's buffers
    pushes.finish(taken.push, counted=True)
    assert not retry.wait.done and len(released.seen) == 2


def test_a_newer_step_drops_a_push_whose_lanes_never_all_came():
    pushes, released = lanes()
    stuck = pushes.add(3, 7, 0, 2, grads("w.block0"), {"step": 7})
    newer = pushes.add(3, 8, 1, 2, grads("w.block1"), {"step": 8})
    assert stuck.wait.done and newer.whole is None
    with pytest.raises(Refusal, match="replaced by another attempt"):
        pushes.outcome(stuck)
    assert released.seen == [{"step": 7}]


def test_the_same_lane_twice_keeps_the_newer_copy():
    pushes, released = lanes()
    pushes.add(3, 7, 0, 2, grads("w.block0"), {"copy": 1})
    pushes.add(3, 7, 0, 2, grads("w.block0"), {"copy": 2})
    assert released.seen == [{"copy": 1}]
    whole = pushes.add(3, 7, 1, 2, grads("w.block1"), {"copy": 3})
    assert whole.whole is not None
    pushes.finish(whole.push, counted=True)
    assert len(released.seen) == 3


def test_an_engine_error_reaches_every_lane_and_a_retry_starts_afresh():
    pushes, released = lanes()
    waiting = pushes.add(3, 7, 0, 2, grads("w.block0"), {})
    whole = pushes.add(3, 7, 1, 2, grads("w.block1"), {})
    pushes.finish(whole.push, error=BadRequest("NaN in w.block1"))
    with pytest.raises(BadRequest, match="NaN"):
        pushes.outcome(waiting)
    again = pushes.add(3, 7, 0, 2, grads("w.block0"), {})
    assert again.whole is None and not again.wait.done


def test_a_roll_back_ends_a_lane_waiting_for_its_partner():
    rollbacks = SimpleNamespace(made=0, restored_from=5)
    released = Released()
    waits = Waits(threading.Condition(), "127.0.0.1:1", 5.0, rollbacks)
    pushes = LanePushes(waits, released, BLOCKS)
    waiting = pushes.add(3, 7, 0, 2, grads("w.block0"), {})
    rollbacks.made = 1
    with waits.cv:
        waits.notify()
    with pytest.raises(MustResync, match="rolled back"):
        waiting.wait.result()


@pytest.mark.parametrize(
    "lane,count,match",
    [
        (2, 2, "lane 2 of a push"),
        (-1, 2, "lane -1"),
        (0, 17, "split across 17 lanes"),
        (0, 1, "split across 1 lanes"),
    ],
)
def test_a_lane_out_of_range_is_refused_and_its_buffers_released(lane, count, match):
    pushes, released = lanes()
    with pytest.raises(BadRequest, match=match):
        pushes.add(3, 7, lane, count, grads("w.block0"), {"refused": True})
    assert released.seen == [{"refused": True}]


def test_a_block_in_two_lanes_is_refused_for_every_lane():
    pushes, released = lanes()
    waiting = pushes.add(3, 7, 0, 2, grads("w.block0"), {"lane": 0})
    with pytest.raises(BadRequest, match="more than one lane"):
        pushes.add(3, 7, 1, 2, grads("w.block0"), {"lane": 1})
    with pytest.raises(BadRequest, match="more than one lane"):
        pushes.outcome(waiting)
    assert len(released.seen) == 2


def test_a_lane_whose_partner_never_comes_times_out_naming_its_trainer():
    pushes, released = lanes(timeout=0.01)
    waiting = pushes.add(3, 7, 0, 2, grads("w.block0"), {})
    waiting.wait.expire()
    with pytest.raises(BarrierTimeout, match=r"trainer 3's push of step 7 still waits for trainers \[3\]"):
        waiting.wait.result()


def test_pushes_of_several_trainers_are_held_apart():
    pushes, _ = lanes()
    a = pushes.add(1, 4, 0, 2, grads("w.block0"), {})
    b = pushes.add(2, 9, 0, 2, grads("w.block0"), {})
    assert pushes.held() == 2
    whole = pushes.add(2, 9, 1, 2, grads("w.block1"), {})
    pushes.finish(whole.push, counted=True)
    assert b.wait.done and not a.wait.done and pushes.held() == 1


def test_merge_keeps_sparse_and_dense_apart():
    dense, sparse = merge({1: ({"w.block1": 1}, {}), 0: ({"w.block0": 0}, {"emb": ("ids", "rows")})})
    assert dense == {"w.block0": 0, "w.block1": 1} and sparse == {"emb": ("ids", "rows")}


def test_settle_pushes_the_whole_once_and_the_other_lane_learns_it():
    pushes, _ = lanes()
    waiting = pushes.add(3, 7, 0, 2, grads("w.block0"), {})
    whole = pushes.add(3, 7, 1, 2, grads("w.block1"), {})
    pushed = []

    def push_whole(dense, sparse):
        pushed.append(sorted(dense))
        return True
        yield  # a parking generator that never parks

    assert list(_drive(pushes.settle(whole, push_whole))) == [True]
    assert pushed == [["w.block0", "w.block1"]]
    assert list(_drive(pushes.settle(waiting, push_whole))) == [True]
    assert len(pushed) == 1


def test_a_completing_call_that_goes_away_while_its_push_waits_ends_the_other_lanes():
    pushes, released = lanes()
    waiting = pushes.add(3, 7, 0, 2, grads("w.block0"), {})
    whole = pushes.add(3, 7, 1, 2, grads("w.block1"), {})

    def push_whole(dense, sparse):
        yield "parked past max_staleness"
        return True

    settling = pushes.settle(whole, push_whole)
    assert next(settling) == "parked past max_staleness"
    settling.close()  # the client cancelled: GeneratorExit at the wait
    with pytest.raises(Refusal, match="went away before it counted"):
        pushes.outcome(waiting)
    assert len(released.seen) == 2


def _drive(settling):
    """Run a settle generator that never parks; its result."""
    try:
        while True:
            next(settling)
    except StopIteration as done:
        yield done.value


def test_a_late_lane_of_an_abandoned_attempt_cannot_make_a_newer_attempt_whole():
    # Attempt 1 failed at the trainer, which cancelled its lanes and sent attempt 2; attempt 1's lane 2 still
    # reached the pserver. Taken for attempt 2's, it would complete the push and leave attempt 2's own lane 2
    # waiting for partners that already went: the stall the chaos variant in lanes found.
    pushes, released = lanes()
    three = {0: grads("w.block0"), 1: grads("w.block1"), 2: grads("b.block0")}
    second = [pushes.add(3, 15, k, 3, three[k], {"attempt": 2, "lane": k}, ("s", 2)) for k in (0, 1)]
    with pytest.raises(Refusal, match="attempt 1 at step 15 came after attempt 2"):
        pushes.add(3, 15, 2, 3, three[2], {"attempt": 1, "lane": 2}, ("s", 1))
    assert released.seen == [{"attempt": 1, "lane": 2}]
    assert not any(t.wait.done for t in second)
    whole = pushes.add(3, 15, 2, 3, three[2], {"attempt": 2, "lane": 2}, ("s", 2))
    assert whole.whole is not None


def test_a_newer_attempt_replaces_an_older_one_that_never_became_whole():
    pushes, released = lanes()
    old = pushes.add(3, 15, 0, 2, grads("w.block0"), {"attempt": 1}, ("s", 1))
    new = pushes.add(3, 15, 0, 2, grads("w.block0"), {"attempt": 2}, ("s", 2))
    with pytest.raises(Refusal, match="replaced by another attempt"):
        pushes.outcome(old)
    assert released.seen == [{"attempt": 1}] and not new.wait.done


def test_a_new_session_starts_its_attempts_afresh():
    # A restarted trainer process counts attempts from 1 again, under a session of its own.
    pushes, released = lanes()
    pushes.add(3, 15, 0, 2, grads("w.block0"), {"old": True}, ("old session", 9))
    fresh = pushes.add(3, 15, 0, 2, grads("w.block0"), {"new": True}, ("new session", 1))
    assert not fresh.wait.done and released.seen == [{"old": True}]
    assert pushes.add(3, 15, 1, 2, grads("w.block1"), {}, ("new session", 1)).whole is not None
