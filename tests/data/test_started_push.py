"""A push-pull sent over a data connection and read later (trainer/transport/data/started.py): what reading
its answer gives, table by table: the pserver's step; the push made again on a new connection where the
connection broke (as a push-pull in one piece retries then); every other failure raised as that call raises
it; the pserver's contact in flight from the send until the answer; and of several started pushes, the one
whose answer arrived read first (:func:`answered_first`)."""

from __future__ import annotations

import socket
import time

import grpc
import pytest

from trainer.errors import REFUSED, RESYNC, TIMEOUT, PserverError
from trainer.transport.contact import Contact
from trainer.transport.data.data_channel import DataCallError
from trainer.transport.data.started import StartedPush, answered_first


class Sent:
    """A started push-pull whose answer is ``answer``: a result tuple, or an exception to raise."""

    def __init__(self, answer, connection=None):
        self.answer, self.abandoned, self.connection = answer, False, connection

    def fileno(self):
        return self.connection.fileno() if self.connection is not None else -1

    def buffered(self):
        return False

    def finish(self, timeout):
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer

    def abandon(self):
        self.abandoned = True


def started(answer, again=lambda: 99, connection=None, timeout=5.0):
    contact, counted = Contact(), []
    contact.begin()
    push = StartedPush(
        "ps:1",
        Sent(answer, connection),
        contact,
        timeout,
        "step 3",
        again,
        lambda s, r: counted.append((s, r)),
    )
    return push, contact, counted


@pytest.mark.parametrize(
    "answer, step, kind, says, again_called",
    [
        ((4, True, 100, 200), 4, None, None, False),  # answered
        (DataCallError(grpc.StatusCode.UNAVAILABLE, "broke"), 99, None, None, True),  # made again: its step
        (DataCallError(grpc.StatusCode.CANCELLED, "shutting down"), 99, None, None, True),
        (
            DataCallError(grpc.StatusCode.DEADLINE_EXCEEDED, "late"),
            None,
            TIMEOUT,
            "late",
            False,
        ),  # no 2nd wait
        (DataCallError(grpc.StatusCode.ABORTED, "rolled back"), None, RESYNC, "rolled back", False),
        (DataCallError(grpc.StatusCode.FAILED_PRECONDITION, "stale"), None, REFUSED, "stale", False),
        (ValueError("rows of 3 x 4"), None, REFUSED, "answer is malformed: rows of 3 x 4", False),
    ],
)
def test_reading_a_started_push_s_answer(answer, step, kind, says, again_called):
    calls = []
    push, contact, counted = started(answer, again=lambda: calls.append(1) or 99)
    assert contact.last(now=123.0) == 123.0  # in flight: contact now
    if kind is None:
        assert push.finish() == step
    else:
        with pytest.raises(PserverError, match=says) as raised:
            push.finish()
        assert raised.value.kind == kind and raised.value.endpoint == "ps:1"
    assert bool(calls) == again_called
    assert counted == ([(100, 200)] if step == 4 else [])
    assert contact.last(now=1e12) < 1e12  # no longer in flight


def test_an_abandoned_push_closes_its_connection_and_ends_its_contact():
    push, contact, _ = started((4, True, 1, 1))
    push.abandon()
    assert push._started.abandoned and contact.last(now=1e12) < 1e12


@pytest.fixture
def connections():
    """Three socket pairs: (the trainer's end, the pserver's end) each."""
    pairs = [socket.socketpair() for _ in range(3)]
    yield pairs
    for pair in pairs:
        for end in pair:
            end.close()


@pytest.mark.parametrize("answered", [["b"], ["c"], ["a", "c"], ["b", "c"]])
def test_of_several_started_pushes_one_whose_answer_arrived_is_read_first(connections, answered):
    pushes = {key: started((1, True, 0, 0), connection=pair[0])[0] for key, pair in zip("abc", connections)}
    for key, pair in zip("abc", connections):
        if key in answered:
            pair[1].sendall(b"answer")  # the pserver's answer, its first bytes arrived
    assert answered_first(pushes) in answered


def test_a_started_push_whose_connection_closed_counts_as_answered(connections):
    closed = started((1, True, 0, 0))[0]  # no descriptor: its finish finds it broken
    waiting = started((1, True, 0, 0), connection=connections[0][0])[0]
    assert answered_first({"waiting": waiting, "closed": closed}) == "closed"


def test_with_no_answer_by_the_earliest_deadline_that_push_is_read(connections):
    late, _, _ = started((1, True, 0, 0), connection=connections[0][0], timeout=0.05)
    later, _, _ = started((1, True, 0, 0), connection=connections[1][0], timeout=60.0)
    begun = time.monotonic()
    assert answered_first({"later": later, "late": late}) == "late"  # its finish then raises it late
    assert time.monotonic() - begun < 30.0


def test_the_last_started_push_is_read_without_waiting_for_its_answer_first(connections):
    only = started((1, True, 0, 0), connection=connections[0][0])[0]  # nothing arrived: its finish waits
    assert answered_first({"only": only}) == "only"
