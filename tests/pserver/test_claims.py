"""Backup trainers' claims (pserver/engine/services/claims.py): who makes a sync step, decided on the first
pserver."""

import threading

import pytest

from pserver.engine.services.claims import StepClaims, Verdict, abandoned, full, verdict
from pserver.errors import BarrierTimeout

MADE = {4: (0, 2), 5: (1, 2)}


@pytest.mark.parametrize(
    "case, step, trainer, applied, expected",
    [
        ("a trainer of a made step is admitted", 4, 2, 4, Verdict(True, (0, 2))),
        ("a trainer not in a made step is dropped, told who made it", 4, 1, 5, Verdict(False, (0, 2))),
        ("a step redone after a roll-back keeps its trainers", 5, 1, 3, Verdict(True, (1, 2))),
        ("a step applied and forgotten: a straggler's claim is dropped", 2, 0, 6, Verdict(False, ())),
        ("a step not made and not applied is open: the claim counts", 6, 0, 6, None),
        ("after a roll-back past the remembered steps, an old step is open again", 1, 0, 1, None),
    ],
)
def test_verdict(case, step, trainer, applied, expected):
    assert verdict(step, trainer, MADE, applied) == expected, case


@pytest.mark.parametrize(
    "case, claimed, live, needed, made",
    [
        ("N - b claims make the step", 3, 4, 3, True),
        ("fewer wait", 2, 4, 3, False),
        ("fewer live trainers than N - b: every live one's claim makes it", 2, 2, 3, True),
        ("no claim makes nothing, even with nobody live", 0, 0, 3, False),
    ],
)
def test_full(case, claimed, live, needed, made):
    assert full(claimed, live, needed) is made, case


def claims(live, applied=lambda: 0, timeout=5.0, trainers=3, backups=1, **hooks):
    """The claims service of ``trainers`` with ``backups``, ``live`` read at each call (a set the test may
    change); ``hooks``: ``on_made``, ``counted``."""
    return StepClaims(
        "ps0",
        trainers=trainers,
        backups=backups,
        barrier_timeout=timeout,
        live=lambda: set(live),
        applied=applied,
        admit=lambda t: None,
        **hooks,
    )


def test_the_first_two_of_three_make_the_step_and_the_third_is_dropped():
    c = claims({0, 1, 2})
    got = {}
    first = threading.Thread(target=lambda: got.setdefault(1, c.claim(1, step=0)))
    first.start()
    assert c.claim(0, step=0) == Verdict(True, (0, 1))
    first.join(5)
    assert got[1] == Verdict(True, (0, 1))
    assert c.claim(2, step=0) == Verdict(False, (0, 1))
    assert c.claim(0, step=0) == Verdict(True, (0, 1))  # a retry learns the same


def test_a_step_waiting_for_claims_is_made_when_a_trainer_leaves():
    live = {0, 1, 2}
    c = claims(live, backups=0)
    got = []
    waiter = threading.Thread(target=lambda: got.append(c.claim(0, step=7)))
    waiter.start()
    live -= {1, 2}  # both others closed: the step waits for trainer 0 alone
    c.roster_changed()
    waiter.join(5)
    assert got == [Verdict(True, (0,))]


def test_a_claim_nobody_joins_times_out_naming_the_missing_trainers():
    c = claims({0, 1, 2}, timeout=0.2)
    with pytest.raises(BarrierTimeout, match=r"trainers of step 3.*\[1, 2\]"):
        c.claim(0, step=3)


def test_a_restarted_first_pserver_learns_a_step_s_trainers_from_a_retried_push():
    """Trainers 0 and 1 made step 5 before the first pserver restarted; their pushes, retried to it,
    name the set, so trainer 2's claim of step 5 there is dropped, not a new set of its own."""
    c = claims({0, 1, 2})
    c.learn(5, [1, 0])
    assert c.claim(2, step=5) == Verdict(False, (0, 1))
    c.learn(5, [2])  # a set known is kept
    assert c.claim(0, step=5) == Verdict(True, (0, 1))


def test_under_hot_standby_each_set_reaches_the_backup_before_its_claim_is_answered():
    """The primary hands each set to ``on_made`` (the replication stream) as it makes it, before any claim
    of it returns; a backup fed those sets (``learn_all``, as its follower does) and then leading gives
    every later claim of the step the same verdict, so no trainer learns a set the backup lacks."""
    backup = claims({0, 1, 2})
    streamed = []

    def on_made(sets):
        streamed.append(dict(sets))
        backup.learn_all({str(s): list(t) for s, t in sets.items()})  # as the JSON message carries them

    primary = claims({0, 1, 2}, on_made=on_made)
    got = {}
    first = threading.Thread(target=lambda: got.setdefault(2, primary.claim(2, step=3)))
    first.start()
    assert primary.claim(0, step=3) == Verdict(True, (0, 2))
    first.join(5)
    assert streamed == [{3: (0, 2)}]  # once, when made
    primary.learn(4, [1, 2])  # a set learnt from a retried push travels too
    assert streamed[-1] == {4: (1, 2)}
    # The primary is lost: the backup leads. A claim retried there, and the straggler's, agree with it.
    assert backup.claim(2, step=3) == Verdict(True, (0, 2))
    assert backup.claim(1, step=3) == Verdict(False, (0, 2))
    assert backup.claim(0, step=4) == Verdict(False, (1, 2))


def test_a_backup_that_joins_later_gets_every_set_remembered_as_one_message():
    streamed = []
    c = claims({0, 1}, trainers=2, on_made=lambda sets: streamed.append(dict(sets)))
    c.claim(1, step=0)
    c.claim(0, step=1)
    c.replicate_all()
    assert streamed == [{0: (1,)}, {1: (0,)}, {0: (1,), 1: (0,)}]


@pytest.mark.parametrize(
    "case, step, trainers, live, applied, counted, forgotten",
    [
        (
            "every trainer of the set left, nothing of it counted: claimed again",
            5,
            {0},
            {1, 2},
            5,
            False,
            True,
        ),
        (
            "one of the set is live: the step waits for it (or applies without the others)",
            5,
            {0, 1},
            {1},
            5,
            False,
            False,
        ),
        ("a push of the set counted on the deciding pserver: kept", 5, {0}, {1}, 5, True, False),
        ("an applied step keeps its set (a straggler's claim is dropped)", 4, {0}, {1}, 5, False, False),
    ],
)
def test_abandoned(case, step, trainers, live, applied, counted, forgotten):
    assert abandoned(step, trainers, live, applied, lambda: counted) is forgotten, case


def test_a_set_whose_trainers_all_left_is_forgotten_and_replicated_as_forgotten():
    """Trainer 0 alone made step 2 and left before pushing it: the next claim of the step (trainer 1's)
    forgets that set, the backup hears an empty set (forget it too), and trainer 1 makes the step."""
    live = {0, 1}
    streamed = []
    backup = claims({0, 1})
    c = claims(
        live,
        applied=lambda: 2,
        trainers=2,
        on_made=lambda sets: (streamed.append(dict(sets)), backup.learn_all(sets)),
        counted=lambda step: False,
    )
    assert c.claim(0, step=2) == Verdict(True, (0,))
    assert c.claim(1, step=2) == Verdict(False, (0,))  # trainer 0 still live: the set stands
    live.discard(0)  # dropped for silence before pushing
    c.roster_changed()
    assert streamed[-1] == {2: ()}
    assert c.claim(1, step=2) == Verdict(True, (1,))
    assert streamed[-1] == {2: (1,)}
    assert backup.claim(1, step=2) == Verdict(True, (1,))


def test_a_step_in_progress_is_found_behind_an_older_step_learnt_since():
    """A set learnt from a retried push of an older step comes after the step in progress in the service's
    memory: the step in progress whose trainers left is still found and claimed again."""
    live = {0, 1}
    c = claims(live, applied=lambda: 10, trainers=2)
    assert c.claim(0, step=10) == Verdict(True, (0,))
    c.learn(5, [1])  # an old step's set, from a retried push
    live.discard(0)
    assert c.claim(1, step=10) == Verdict(True, (1,))
