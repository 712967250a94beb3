"""Recovery's pure core: every decision a trainer takes after a failure or at a join, without processes.

Each row is a situation the process tests in test_recovery.py reach by killing
real pservers and trainers: what the pservers answered at Hello, and what the
trainer must do next.
"""

import grpc
import pytest

from trainer.errors import DOWN, FENCED, REFUSED, RESYNC, TIMEOUT
from trainer.recovery import decide
from trainer.recovery.decide import (
    FAIL,
    JOIN,
    RESTORE,
    RETRY,
    ROLLBACK,
    SKIP,
    WAIT,
    PserverState,
    after_failure,
    join_token,
    on_join,
)
from trainer.transport import kind_of

A, B = "127.0.0.1:6170", "127.0.0.1:6171"
KNOWN = {A: 11, B: 22}  # incarnations the trainer saw before the failure


def ps(incarnation, step, checkpoint_step=-1, position=(0, 0), counted=-1, applied=None, others=0):
    return PserverState(incarnation, step, checkpoint_step, position, counted, applied, others)


@pytest.mark.parametrize(
    "kind, healable",
    [
        (DOWN, True),  # pserver down, restarting or shutting down
        (RESYNC, True),  # dropped, rolled back, resumed: call Hello again
        (FENCED, False),  # a newer process holds the id: this one must stop
        (TIMEOUT, False),  # a barrier that timed out names who is missing
        (REFUSED, False),  # bad input, a precondition, a bug
        (None, False),  # a malformed answer, no kind at all
    ],
)
def test_which_failures_heal(kind, healable):
    assert decide.recoverable(kind) is healable


@pytest.mark.parametrize(
    "code, kind",
    [
        (grpc.StatusCode.UNAVAILABLE, DOWN),
        (grpc.StatusCode.CANCELLED, DOWN),  # a pserver shutting down cancels calls in flight
        (grpc.StatusCode.ABORTED, RESYNC),
        (grpc.StatusCode.PERMISSION_DENIED, FENCED),
        (grpc.StatusCode.DEADLINE_EXCEEDED, TIMEOUT),
        (grpc.StatusCode.FAILED_PRECONDITION, REFUSED),
        (grpc.StatusCode.INVALID_ARGUMENT, REFUSED),
        (grpc.StatusCode.UNAUTHENTICATED, REFUSED),
        (grpc.StatusCode.INTERNAL, REFUSED),
        (None, REFUSED),
    ],
)
def test_the_transport_maps_each_status_code_to_a_kind_once(code, kind):
    """The only place a status code is read: recovery decides on the kind."""
    assert kind_of(code) == kind


# (case, sync_mode, trainer's step, answers, expected (action, step, position, endpoints, restarted))
AFTER_FAILURE = [
    (
        "blip, sync: nobody restarted, same step",
        True,
        5,
        {A: ps(11, 5), B: ps(22, 5)},
        (RETRY, 5, (0, 0), (), ()),
    ),
    ("blip, async: nobody restarted", False, 9, {A: ps(11, 3), B: ps(22, 4)}, (RETRY, 9, (0, 0), (), ())),
    (
        "async restart from a checkpoint: retry, nothing rolls back",
        False,
        9,
        {A: ps(11, 9), B: ps(99, 6, checkpoint_step=40)},
        (RETRY, 9, (0, 0), (), (B,)),
    ),
    (
        "sync, dropped: the others went on without this trainer",
        True,
        5,
        {A: ps(11, 8), B: ps(22, 8)},
        (SKIP, 8, (0, 0), (), ()),
    ),
    (
        "sync, dropped while the others were mid-step: one pserver ahead, none counted its push; tell the "
        "other",
        True,
        5,
        {A: ps(11, 6, counted=4), B: ps(22, 5, counted=4)},
        (SKIP, 6, (0, 0), (B,), ()),
    ),
    (
        "sync, dropped at different moments by each pserver, both went on, one a step further: tell the "
        "other",
        True,
        41,
        {A: ps(11, 45, counted=40), B: ps(22, 44, counted=40)},
        (SKIP, 45, (0, 0), (B,), ()),
    ),
    (
        "sync, overlapping restarts: the pserver ahead counted this trainer's push, the other needs it",
        True,
        20,
        {A: ps(11, 21, counted=20), B: ps(22, 20, counted=19)},
        (RETRY, 20, (0, 0), (), ()),
    ),
    (
        "sync, rejoin step differs from the push step: A applied it with this trainer, B dropped it and went "
        "on",
        True,
        36,
        {A: ps(11, 37, counted=36), B: ps(22, 37, counted=35)},
        (SKIP, 37, (0, 0), (), ()),
    ),
    (
        "sync, the one that counted it stands a step behind the one that dropped it: tell it",
        True,
        36,
        {A: ps(11, 37, counted=36), B: ps(22, 38, counted=35)},
        (SKIP, 38, (0, 0), (A,), ()),
    ),
    (
        "sync, one pserver dropped it and went on, the other counted it and waits: tell that one",
        True,
        36,
        {A: ps(11, 36, counted=36), B: ps(22, 37, counted=35)},
        (SKIP, 37, (0, 0), (A,), ()),
    ),
    (
        "sync, rolled back by another trainer: redo from the checkpoint's position",
        True,
        7,
        {A: ps(11, 4, position=(1, 3)), B: ps(22, 4, position=(1, 3))},
        (ROLLBACK, 4, (1, 3), (), ()),
    ),
    (
        "sync, mid roll-back: go back to the lowest step (the one ahead has this trainer's pushes: rolled "
        "back next)",
        True,
        7,
        {A: ps(11, 7, counted=6), B: ps(22, 4, position=(0, 9))},
        (ROLLBACK, 4, (0, 9), (), ()),
    ),
    (
        "sync, rolled back to 25, but B dropped this trainer and applied 25 without it: go on at 26, tell A",
        True,
        26,
        {A: ps(11, 25, counted=24, position=(1, 2)), B: ps(22, 26, counted=24)},
        (SKIP, 26, (0, 0), (A,), ()),
    ),
    (
        "sync restart from checkpoint 4: roll the other pserver back to it",
        True,
        7,
        {A: ps(11, 7), B: ps(99, 4, checkpoint_step=4)},
        (RESTORE, 4, (0, 0), (A,), (B,)),
    ),
    (
        "sync, both restarted from different checkpoints: all go to the earliest, each told of the other's "
        "restart",
        True,
        7,
        {A: ps(33, 6, checkpoint_step=6), B: ps(99, 4, checkpoint_step=4)},
        (RESTORE, 4, (0, 0), (A, B), (A, B)),
    ),
    (
        "sync, both restarted from the same checkpoint: each is told of the other's restart (it stays where "
        "it is)",
        True,
        7,
        {A: ps(33, 4, checkpoint_step=4, position=(0, 2)), B: ps(99, 4, checkpoint_step=4, position=(0, 2))},
        (RESTORE, 4, (0, 0), (A, B), (A, B)),
    ),
    (
        "sync, B restarted from 60 and went on with the others (not needing this trainer) to 81: no "
        "roll-back, skip",
        True,
        65,
        {A: ps(11, 81, counted=59), B: ps(99, 80, checkpoint_step=60, counted=59)},
        (SKIP, 81, (0, 0), (B,), (B,)),
    ),
    (
        "sync restart without a checkpoint: its parameters are lost",
        True,
        7,
        {A: ps(11, 7), B: ps(99, 0, checkpoint_step=-1)},
        (FAIL, 7, (0, 0), (B,), (B,)),
    ),
    (
        "async restart without a checkpoint: lost too",
        False,
        7,
        {A: ps(11, 7), B: ps(99, 0, checkpoint_step=-1)},
        (FAIL, 7, (0, 0), (B,), (B,)),
    ),
]


@pytest.mark.parametrize(
    "case, sync_mode, step, answers, expected", AFTER_FAILURE, ids=[row[0] for row in AFTER_FAILURE]
)
def test_after_failure(case, sync_mode, step, answers, expected):
    d = after_failure(sync_mode, KNOWN, step, answers, [A, B])
    assert (d.action, d.step, d.position, d.endpoints, d.restarted) == expected
    if d.action == FAIL:
        assert "restarted without a checkpoint" in d.message and "checkpoint_dir" in d.message


def test_restore_token_names_the_restart_so_pservers_roll_back_once():
    answers = {A: ps(11, 7), B: ps(99, 4, checkpoint_step=4)}
    first = after_failure(True, KNOWN, 7, answers, [A, B])
    again = after_failure(True, KNOWN, 7, answers, [A, B])  # another trainer sees the same restart
    assert first.restores == again.restores == ((A, f"{B}#99"),)
    later = after_failure(True, KNOWN, 7, {A: ps(11, 7), B: ps(123, 4, checkpoint_step=4)}, [A, B])
    assert later.restores == ((A, f"{B}#123"),)  # a second restart is a new roll-back


def test_each_restart_has_its_own_token_however_many_a_trainer_sees_at_once():
    """A trainer that saw A's and B's restarts at once names each as one that saw only one of them does, so a
    pserver that honoured a restart's token for the first does not roll back for it again for the second."""
    both = {A: ps(33, 4, checkpoint_step=4), B: ps(99, 4, checkpoint_step=4)}
    d = after_failure(True, KNOWN, 7, both, [A, B])
    assert d.restores == ((A, f"{B}#99"), (B, f"{A}#33")) and d.tokens_for(A) == (f"{B}#99",)
    only_b = after_failure(True, {A: 33, B: 22}, 7, both, [A, B])
    assert only_b.restores == ((A, f"{B}#99"),)


def test_after_a_restore_the_restart_is_known_and_the_trainer_rolls_back():
    """The healer asks again after Restore, with the incarnations it restored for as known."""
    answers = {A: ps(11, 4, position=(0, 5)), B: ps(99, 4, checkpoint_step=4, position=(0, 5))}
    d = after_failure(True, {A: 11, B: 99}, 7, answers, [A, B])
    assert (d.action, d.step, d.position, d.restarted) == (ROLLBACK, 4, (0, 5), ())


def test_steps_of_pservers_this_trainer_does_not_push_to_are_ignored():
    # B owns nothing of this trainer's: its step does not move the trainer.
    d = after_failure(True, KNOWN, 5, {A: ps(11, 5), B: ps(22, 9)}, [A])
    assert (d.action, d.step) == (RETRY, 5)


# (case, sync_mode, answers, time left, roll-backs already asked for, expected (action, step, position,
# endpoints))
AB = (A, B)
BEHIND_28 = {A: ps(11, 30), B: ps(99, 28, checkpoint_step=28)}
ROLL_BACK_28 = f"join@28:{A}#11@30,{B}#99@28"
ON_JOIN = [
    ("new trainer, fresh sync job", True, {A: ps(11, 0), B: ps(22, 0)}, 10.0, (), (JOIN, 0, (0, 0), ())),
    (
        "rejoin a sync job at its step and this trainer's data position",
        True,
        {A: ps(11, 12, position=(2, 7)), B: ps(22, 12, position=(2, 7))},
        10.0,
        (),
        (JOIN, 12, (2, 7), ()),
    ),
    (
        "rejoin after the step in progress, which the other trainers complete",
        True,
        {A: ps(11, 13, applied=12, others=1), B: ps(22, 13, applied=12, others=1)},
        10.0,
        (),
        (JOIN, 13, (0, 0), ()),
    ),
    (
        "async: the trainer's own next step, the furthest of any pserver",
        False,
        {A: ps(11, 3, position=(0, 3)), B: ps(22, 5)},
        10.0,
        (),
        (JOIN, 5, (0, 3), ()),
    ),
    (
        "sync pservers a step apart mid-step: ask again, joining at the highest step",
        True,
        {A: ps(11, 4, others=1), B: ps(22, 5)},
        10.0,
        (),
        (WAIT, 5, (0, 0), AB),
    ),
    (
        "a step apart, B restarted at checkpoint 50 and another trainer's push of 50 is in: mid-step, ask "
        "again",
        True,
        {A: ps(11, 51, applied=51), B: ps(99, 50, checkpoint_step=50, others=1)},
        10.0,
        (),
        (WAIT, 51, (0, 0), AB),
    ),
    (
        "no trainer alive: B restarted from checkpoint 28, A stands at 30: roll every pserver back to 28",
        True,
        BEHIND_28,
        10.0,
        (),
        (RESTORE, 28, (0, 0), AB),
    ),
    (
        "no trainer alive, a step apart: B (restarted from 28) waits for nobody but this trainer, which "
        "joins at 29",
        True,
        {A: ps(11, 29), B: ps(99, 29, checkpoint_step=28, applied=28)},
        10.0,
        (),
        (RESTORE, 28, (0, 0), AB),
    ),
    (
        "stalled a step after its checkpoint: both go back to the checkpoint it started from",
        True,
        {A: ps(11, 30), B: ps(99, 30, checkpoint_step=28, applied=29)},
        10.0,
        (),
        (RESTORE, 28, (0, 0), AB),
    ),
    (
        "two trainers joining at once find the same state: the roll-back already asked for is not asked "
        "again",
        True,
        BEHIND_28,
        10.0,
        (ROLL_BACK_28,),
        (WAIT, 30, (0, 0), AB),
    ),
    (
        "B restarted again after a roll-back: a new state, a new roll-back",
        True,
        {A: ps(11, 30), B: ps(123, 28, checkpoint_step=28)},
        10.0,
        (ROLL_BACK_28,),
        (RESTORE, 28, (0, 0), AB),
    ),
    (
        "B behind without a checkpoint (none written, or no checkpoint_dir): wait, nothing to roll back to",
        True,
        {A: ps(11, 3), B: ps(99, 0)},
        10.0,
        (),
        (WAIT, 3, (0, 0), AB),
    ),
    (
        "sync pservers still a step apart at the deadline: fail",
        True,
        {A: ps(11, 4, others=1), B: ps(22, 5)},
        0.0,
        (),
        (FAIL, 0, (0, 0), AB),
    ),
    (
        "B behind without a checkpoint at the deadline: fail, naming what is missing",
        True,
        {A: ps(11, 3), B: ps(99, 0)},
        0.0,
        (),
        (FAIL, 0, (0, 0), AB),
    ),
    (
        "still apart at the deadline after the roll-back was asked for: fail",
        True,
        BEHIND_28,
        0.0,
        (ROLL_BACK_28,),
        (FAIL, 0, (0, 0), AB),
    ),
    (
        "async pservers at different steps are fine",
        False,
        {A: ps(11, 4), B: ps(22, 5)},
        0.0,
        (),
        (JOIN, 5, (0, 0), ()),
    ),
    (
        "async, B restarted from an older checkpoint than A stands at: each goes on from where it is",
        False,
        {A: ps(11, 31, position=(1, 5)), B: ps(99, 28, checkpoint_step=40, position=(1, 2))},
        10.0,
        (),
        (JOIN, 31, (1, 5), ()),
    ),
]


@pytest.mark.parametrize(
    "case, sync_mode, answers, time_left, restored, expected", ON_JOIN, ids=[r[0] for r in ON_JOIN]
)
def test_on_join(case, sync_mode, answers, time_left, restored, expected):
    d = on_join(sync_mode, answers, [A, B], time_left, frozenset(restored))
    assert (d.action, d.step, d.position, d.endpoints) == expected
    if d.action in (FAIL, WAIT, RESTORE):
        assert "disagree on the current step" in d.message
    if d.action == RESTORE:
        assert d.restores == tuple((ep, join_token(answers, d.step)) for ep in sorted(answers))


@pytest.mark.parametrize(
    "answers, restored, missing",
    [
        (
            {A: ps(11, 3), B: ps(99, 0)},
            (),
            "stand at step 0 without a checkpoint at that step to roll the others back "
            "to (no checkpoint_dir, or none complete yet)",
        ),
        (BEHIND_28, (ROLL_BACK_28,), "still apart after rolling them back to the checkpoint at step 28"),
        ({A: ps(11, 4, others=1), B: ps(22, 5)}, (), "still apart at the deadline"),
    ],
)
def test_a_failed_join_names_what_is_missing(answers, restored, missing):
    d = on_join(True, answers, [A, B], 0.0, frozenset(restored))
    assert d.action == FAIL and missing in d.message


def test_joining_trainers_that_find_the_same_state_ask_for_the_same_roll_back():
    assert (
        on_join(True, BEHIND_28, [A, B], 10.0).restores
        == on_join(True, dict(BEHIND_28), [A, B], 5.0).restores
    )
    moved = on_join(True, {A: ps(11, 31), B: ps(99, 28, checkpoint_step=28)}, [A, B], 10.0)
    assert moved.action == RESTORE and ROLL_BACK_28 not in moved.tokens_for(A)


def test_join_with_no_pserver_to_push_to():
    assert on_join(True, {A: ps(11, 3)}, [], 1.0) == decide.Decision(JOIN, 0, (0, 0))
