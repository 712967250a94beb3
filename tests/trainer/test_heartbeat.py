"""The heartbeat thread's decisions: which pservers get a heartbeat now, and when it looks again (tables)."""
import math

import pytest

from trainer.heartbeat import CHECKS_PER_INTERVAL, heartbeats_due, next_check

NEVER = -math.inf  # a pserver this trainer never reached
I = 2.0            # heartbeat_interval

# (case, last contact per pserver, now, expected pservers to heartbeat)
DUE = [
    ("steady training: every pserver reached within the interval", {"a": 99.5, "b": 99.9}, 100.0, []),
    ("one pserver silent for exactly an interval", {"a": 98.0, "b": 99.9}, 100.0, ["a"]),
    ("one pserver silent for more than an interval", {"a": 97.0, "b": 99.9}, 100.0, ["a"]),
    ("idle towards every pserver (a data stall)", {"a": 97.0, "b": 90.0}, 100.0, ["a", "b"]),
    ("a push parked in a barrier since 98.5: it started 1.5 s ago, not yet due", {"a": 98.5}, 100.0, []),
    ("the same push parked since 97.9: its start is older than an interval", {"a": 97.9}, 100.0, ["a"]),
    ("a pserver never reached (a node's leader: another local rank's pserver)", {"a": 99.9, "b": NEVER}, 100.0,
     ["b"]),
    ("no pservers", {}, 100.0, []),
]


@pytest.mark.parametrize("case, contacts, now, expected", DUE, ids=[c[0] for c in DUE])
def test_heartbeats_due(case, contacts, now, expected):
    assert heartbeats_due(contacts, now, I) == expected


FLOOR = I / CHECKS_PER_INTERVAL
# (case, last contact per pserver after this round's heartbeats, now, expected seconds to the next look)
NEXT = [
    ("the earliest falls due in 1.5 s", {"a": 99.5, "b": 99.9}, 100.0, 1.5),
    ("every pserver just reached: a whole interval", {"a": 100.0, "b": 100.0}, 100.0, I),
    ("one falls due in a moment: no sooner than the floor", {"a": 98.01, "b": 100.0}, 100.0, FLOOR),
    ("one already due (its heartbeat failed: the thread's try counts): the floor", {"a": 97.0}, 100.0, FLOOR),
    ("no pservers: an interval", {}, 100.0, I),
    ("a contact from the future (clock read before a call noted it): at most an interval", {"a": 101.0}, 100.0, I),
]


@pytest.mark.parametrize("case, contacts, now, expected", NEXT, ids=[c[0] for c in NEXT])
def test_next_check(case, contacts, now, expected):
    assert next_check(contacts, now, I) == pytest.approx(expected)
