"""Contact (trainer/transport/contact.py): a call in flight is contact; an answered one until its answer."""

from __future__ import annotations

import time

import pytest

from trainer.transport.contact import Contact


def test_no_call_yet_is_no_contact():
    assert Contact().last(100.0) == float("-inf")


@pytest.mark.parametrize("from_start", [True, False])
def test_a_call_in_flight_is_contact_now_only_when_counted_from_its_start(from_start):
    c = Contact()
    c.noted(1.0)
    with c.call(from_start=from_start):
        now = time.monotonic() + 100
        assert c.last(now) == (now if from_start else 1.0)


def test_an_answered_call_is_contact_until_its_answer():
    c = Contact()
    before = time.monotonic()
    with c.call():
        pass
    after = time.monotonic()
    assert before <= c.last(after + 100) <= after


def test_a_streamed_call_counts_from_its_start_once_answered():
    c = Contact()
    before = time.monotonic()
    with c.call(from_start=False):
        time.sleep(0.01)  # the stream's own duration: its start, not its answer, is what counts
        streamed_until = time.monotonic()
    assert before <= c.last(time.monotonic() + 100) < streamed_until


@pytest.mark.parametrize("from_start", [True, False])
def test_a_failed_call_counts_from_its_start_only_if_it_was_counted_in_flight(from_start):
    c = Contact()
    c.noted(1.0)
    before = time.monotonic()
    with pytest.raises(RuntimeError):
        with c.call(from_start=from_start):
            raise RuntimeError("UNAVAILABLE")
    last = c.last(time.monotonic() + 100)
    assert (before <= last < before + 1) if from_start else last == 1.0


def test_nested_calls_keep_contact_until_the_last_ends():
    c = Contact()
    with c.call():
        with c.call():
            pass
        now = time.monotonic() + 100
        assert c.last(now) == now
    assert c.last(time.monotonic() + 100) < time.monotonic() + 1
