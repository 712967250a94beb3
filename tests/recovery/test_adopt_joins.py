"""A trainer joining a layout it has just adopted (sync): it tells each pserver of the others' possible
restarts since the commit (:func:`trainer.recovery.decide.restarts_unseen`); outside an adoption, and in
async mode, a join decides as before (tests/recovery/test_decisions.py)."""

from __future__ import annotations

import pytest

from tests.recovery.test_decisions import A, B, ps
from trainer.recovery import decide
from trainer.recovery.decide import JOIN, RESTORE, on_join


# A layout just adopted (on_join's new_layout): every pserver started from the switch step's checkpoint (47)
# at the commit; A may have restarted since. (case, answers, tokens already told, expected (action, step,
# restores)).
def told(ep, restarted_ep, incarnation):
    return (ep, decide.restart_token(restarted_ep, incarnation))


NEW_LAYOUT = [
    (
        "nobody restarted: each pserver is told of the other's start (standing there unchanged, it stays)",
        {A: ps(11, 47, checkpoint_step=47), B: ps(22, 47, checkpoint_step=47)},
        (),
        (RESTORE, 47, (told(A, B, 22), told(B, A, 11))),
    ),
    (
        "A restarted since, unseen; B counted another trainer's push of 47 from before: B is told of A's "
        "restart too, so another trainer's later roll-back for it undoes nothing this trainer pushes",
        {A: ps(99, 47, checkpoint_step=47), B: ps(22, 47, checkpoint_step=47, others=1)},
        (),
        (RESTORE, 47, (told(A, B, 22), told(B, A, 99))),
    ),
    (
        "every start told: join",
        {A: ps(99, 47, checkpoint_step=47), B: ps(22, 47, checkpoint_step=47)},
        (decide.restart_token(B, 22), decide.restart_token(A, 99)),
        (JOIN, 47, ()),
    ),
    (
        "A restarted again while this trainer joined: only that restart is told",
        {A: ps(123, 47, checkpoint_step=47), B: ps(22, 47, checkpoint_step=47)},
        (decide.restart_token(B, 22), decide.restart_token(A, 99)),
        (RESTORE, 47, (told(B, A, 123),)),
    ),
    (
        "a pserver that applied steps since its checkpoint has no start to tell (B); A's restart from a "
        "later checkpoint is told to B",
        {A: ps(99, 50, checkpoint_step=50), B: ps(22, 50, checkpoint_step=47)},
        (),
        (RESTORE, 50, (told(B, A, 99),)),
    ),
    (
        "no checkpoint to stand at: nothing to tell",
        {A: ps(11, 5), B: ps(22, 5)},
        (),
        (JOIN, 5, ()),
    ),
]


@pytest.mark.parametrize("case, answers, restored, expected", NEW_LAYOUT, ids=[r[0] for r in NEW_LAYOUT])
def test_on_join_of_a_layout_just_adopted(case, answers, restored, expected):
    d = on_join(True, answers, [A, B], 10.0, frozenset(restored), new_layout=True)
    assert (d.action, d.step, d.restores) == expected
    if d.action == RESTORE:
        assert d.endpoints == tuple(sorted({ep for ep, _ in d.restores}))
        assert d.restarted and "layout just adopted" in d.message


@pytest.mark.parametrize(
    "answers",
    [r[1] for r in NEW_LAYOUT],
    ids=[r[0] for r in NEW_LAYOUT],
)
def test_a_join_that_is_no_adoption_and_an_async_one_tell_nothing(answers):
    """Outside a layout just adopted, or in async mode (no roll-backs), a join decides as before."""
    assert on_join(True, answers, [A, B], 10.0).action == JOIN
    assert on_join(False, answers, [A, B], 10.0, new_layout=True).action == JOIN
