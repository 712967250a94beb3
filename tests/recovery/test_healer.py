"""Recovery's I/O against scripted channels: every step of a re-sync is retried.

The pservers' answers and failures are played from a script, so sequences that
real processes hit only by chance (a pserver lost during the roll-back of the
others, a pull that fails right after a re-sync) run deterministically.
"""

import functools
from types import SimpleNamespace

import pytest

from tests.helpers.scripted_channels import run_parallel
from trainer.errors import DOWN, REFUSED, RESYNC, PserverError
from trainer.recovery import ROLLBACK, Recovery
from trainer.recovery.decide import JOIN, SKIP

A, B = "127.0.0.1:6170", "127.0.0.1:6171"


def hello(incarnation, step, checkpoint_step=-1, position=(0, 0), counted_step=-1, applied=None, others=0):
    return SimpleNamespace(
        incarnation=incarnation,
        start_step=step,
        checkpoint_step=checkpoint_step,
        epoch=position[0],
        batch=position[1],
        counted_step=counted_step,
        sync_mode=True,
        applied_step=step if applied is None else applied,
        others_in_step=others,
    )


class ScriptedChannels:
    """Answers Hello from ``hellos`` in turn; a Restore to an endpoint in ``restore_fails`` fails once.

    ``restore_fails`` names endpoints (down: UNAVAILABLE) or maps each to the kind of its failure
    (RESYNC: the pserver restarted since this trainer's Hello and no longer knows its session).
    """

    trainer_id = 0

    def __init__(self, hellos, restore_fails=()):
        self.hellos = list(hellos)
        self.restore_fails = (
            dict(restore_fails) if isinstance(restore_fails, dict) else dict.fromkeys(restore_fails, DOWN)
        )
        self.restores = []
        self.join_ats = []

    def hello(self, timeout, join_at=0):
        self.join_ats.append(join_at)
        return self.hellos.pop(0)

    def __getitem__(self, ep):
        """The channel to ``ep``: its Restore is this script's."""
        return SimpleNamespace(restore=functools.partial(self.restore, ep))

    def restore(self, ep, step, token):
        kind = self.restore_fails.pop(ep, None)
        if kind == DOWN:
            raise PserverError(ep, "roll-back failed: UNAVAILABLE: Connection refused", DOWN, "UNAVAILABLE")
        if kind is not None:
            raise PserverError(
                ep, "roll-back failed: ABORTED: trainer 0's session is not known here", kind, "ABORTED"
            )
        self.restores.append((ep, step, token))

    def run_parallel(self, jobs):
        return run_parallel(jobs)


def recovery(comm):
    r = Recovery(comm, sync_mode=True, push_endpoints=[A, B], connect_timeout=5, recovery_timeout=30)
    r.incarnations = {A: 11, B: 22}
    return r


def failing_once():
    failures = [PserverError(B, "step 7 failed: UNAVAILABLE", DOWN, "UNAVAILABLE")]

    def calls():
        if failures:
            raise failures.pop()

    return calls


def test_pserver_lost_during_the_roll_back_of_the_others_is_waited_for_and_the_job_converges():
    comm = ScriptedChannels(
        [
            {A: hello(11, 7), B: hello(99, 4, checkpoint_step=4)},  # B restarted from step 4
            # the roll-back of A failed: A died too, and came back from the same checkpoint; B, which
            # may have gone on meanwhile, is rolled back to it for A's restart, and A hears of B's
            {A: hello(33, 4, checkpoint_step=4), B: hello(99, 5, checkpoint_step=4)},
            {
                A: hello(33, 4, checkpoint_step=4, position=(0, 8)),
                B: hello(99, 4, checkpoint_step=4, position=(0, 8)),
            },
        ],
        restore_fails={A},
    )
    pulled = []
    decision = recovery(comm).heal(7, "step 7", failing_once(), pulled.append)
    assert (decision.action, decision.step, decision.position) == (ROLLBACK, 4, (0, 8))
    assert comm.restores == [(A, 4, f"{B}#99"), (B, 4, f"{A}#33")] and pulled == [4]


def test_a_restart_whose_roll_back_of_the_others_was_interrupted_is_still_told_to_them():
    """The chaos test's flake (seed 1, a full suite on a busy machine), as trainer 1 lived it: A restarted
    from checkpoint 20; rolling B back for it failed, as B had restarted too (from 20) and no longer knew
    the session. B must still hear A's restart (its token): it stands at 20 unchanged and keeps the
    pushes it counted, and a roll-back for that restart asked later by trainer 0, once B has applied
    step 20 with both trainers, is one B already honoured. Forgotten, it rolled B back from 21 to 20
    while trainer 1 went on, which left the job with no step applied until barrier_timeout."""
    comm = ScriptedChannels(
        [
            {A: hello(12, 20, checkpoint_step=20), B: hello(22, 24)},  # A restarted
            {A: hello(12, 20, checkpoint_step=20), B: hello(33, 20, checkpoint_step=20, others=1)},  # B too
            {
                A: hello(12, 20, checkpoint_step=20, position=(0, 20)),
                B: hello(33, 20, checkpoint_step=20, position=(0, 20), others=1),
            },
        ],
        restore_fails={B: RESYNC},
    )
    r = recovery(comm)
    decision = r.heal(23, "step 23", failing_once(), lambda step: None)
    assert (decision.action, decision.step, decision.position) == (ROLLBACK, 20, (0, 20))
    assert sorted(comm.restores) == [(A, 20, f"{B}#33"), (B, 20, f"{A}#12")]
    assert r.incarnations == {A: 12, B: 33}


def test_roll_back_is_asked_again_after_a_second_restart():
    comm = ScriptedChannels(
        [
            {A: hello(11, 7), B: hello(99, 4, checkpoint_step=4)},
            {A: hello(11, 7), B: hello(123, 2, checkpoint_step=2)},  # B restarted again, from step 2
            {
                A: hello(11, 2, checkpoint_step=2, position=(0, 3)),
                B: hello(123, 2, checkpoint_step=2, position=(0, 3)),
            },
        ],
        restore_fails={A},
    )
    r = recovery(comm)
    decision = r.heal(7, "step 7", failing_once(), lambda step: None)
    assert (decision.action, decision.step, decision.position) == (ROLLBACK, 2, (0, 3))
    assert comm.restores == [(A, 2, f"{B}#123")]
    assert r.incarnations == {A: 11, B: 123}


def test_pull_that_fails_right_after_a_re_sync_is_healed_too():
    comm = ScriptedChannels(
        [
            {
                A: hello(11, 4, position=(1, 0)),
                B: hello(22, 4, position=(1, 0)),
            },  # rolled back by another trainer
            {A: hello(11, 4, position=(1, 0)), B: hello(22, 4, position=(1, 0))},  # after the failed pull
        ]
    )
    pulls = []

    def pull(step):
        pulls.append(step)
        if len(pulls) == 1:
            raise PserverError(A, "pull failed: UNAVAILABLE", DOWN, "UNAVAILABLE")

    decision = recovery(comm).heal(7, "step 7", failing_once(), pull)
    assert (decision.action, decision.step, decision.position) == (ROLLBACK, 4, (1, 0))
    assert pulls == [4, 4]


def test_a_refused_roll_back_is_not_retried():
    comm = ScriptedChannels([{A: hello(11, 7), B: hello(99, 4, checkpoint_step=4)}])

    def refuse(ep, step, token):
        raise PserverError(ep, "no complete checkpoint at step 4", REFUSED, "FAILED_PRECONDITION")

    comm.restore = refuse
    with pytest.raises(PserverError, match="no complete checkpoint"):
        recovery(comm).heal(7, "step 7", failing_once(), lambda step: None)


def test_a_dropped_trainer_that_finds_the_pservers_a_step_apart_tells_the_one_behind_where_it_rejoins():
    """Dropped by each pserver at a slightly different moment: A went on to step 45, B stands at 44 and
    counts this trainer in its step 44, whose push will never come (the trainer skips to 45)."""
    comm = ScriptedChannels(
        [
            {A: hello(11, 45, counted_step=40), B: hello(22, 44, counted_step=40)},
            {A: hello(11, 45, counted_step=40), B: hello(22, 45, counted_step=40)},  # B applied 44 without it
        ]
    )
    pulls = []
    decision = recovery(comm).heal(41, "step 41", failing_once(), pulls.append)
    assert (decision.action, decision.step) == (SKIP, 45)
    assert comm.join_ats == [0, 45] and pulls == [45]


def test_a_joining_trainer_that_finds_the_pservers_apart_asks_again_saying_where_it_starts():
    """A pserver a step behind must not wait for a trainer that waits for the pservers to agree."""
    comm = ScriptedChannels(
        [
            {A: hello(11, 8), B: hello(22, 7)},  # mid-step: A applied step 7, B waits for it
            {A: hello(11, 8), B: hello(22, 8)},  # B finished step 7 without this trainer
        ]
    )
    decision = Recovery(
        comm, sync_mode=True, push_endpoints=[A, B], connect_timeout=5, recovery_timeout=30
    ).join()
    assert (decision.action, decision.step) == (JOIN, 8)
    assert comm.join_ats == [0, 8]


def joining(comm) -> Recovery:
    return Recovery(comm, sync_mode=True, push_endpoints=[A, B], connect_timeout=5, recovery_timeout=30)


ROLL_BACK_28 = f"join@28:{A}#11@30,{B}#99@28"


def test_a_joining_trainer_rolls_every_pserver_back_to_the_checkpoint_one_restarted_from():
    """Both trainers were down while B restarted from checkpoint 28 and A stood at 30: nobody else
    would roll A back, so the joining trainer does, then joins at 28 from the checkpoint's position."""
    comm = ScriptedChannels(
        [
            {A: hello(11, 30), B: hello(99, 28, checkpoint_step=28, position=(1, 3))},
            {
                A: hello(11, 28, checkpoint_step=28, position=(1, 3)),
                B: hello(99, 28, checkpoint_step=28, position=(1, 3)),
            },
        ]
    )
    decision = joining(comm).join()
    assert (decision.action, decision.step, decision.position) == (JOIN, 28, (1, 3))
    # B too: it stands at 28 already, and forgets who joined a step later (an abandoned step).
    assert comm.restores == [(A, 28, ROLL_BACK_28), (B, 28, ROLL_BACK_28)]
    assert comm.join_ats == [0, 0]


def test_a_joining_trainer_whose_pservers_a_step_apart_stall_rolls_them_back():
    """A step apart with no trainer alive: B, told this trainer joins at 29, waits for nobody."""
    comm = ScriptedChannels(
        [
            {A: hello(11, 29), B: hello(99, 28, checkpoint_step=28, others=1)},  # B still counts trainer 1
            {A: hello(11, 29), B: hello(99, 29, checkpoint_step=28, applied=28)},  # trainer 1 joins later too
            {A: hello(11, 28, checkpoint_step=28), B: hello(99, 28, checkpoint_step=28)},
        ]
    )
    decision = joining(comm).join()
    assert (decision.action, decision.step) == (JOIN, 28)
    token = f"join@28:{A}#11@29,{B}#99@28"
    assert comm.join_ats == [0, 29, 0] and comm.restores == [(A, 28, token), (B, 28, token)]


def test_a_joining_trainer_asks_for_a_roll_back_once_then_waits_for_the_one_under_way():
    """The pservers answered the same after the roll-back this trainer asked for (another trainer's Hello
    came between): it does not ask again for the same state but asks the pservers again."""
    comm = ScriptedChannels(
        [
            {A: hello(11, 30), B: hello(99, 28, checkpoint_step=28)},
            {A: hello(11, 30), B: hello(99, 28, checkpoint_step=28)},
            {A: hello(11, 28, checkpoint_step=28), B: hello(99, 28, checkpoint_step=28)},
        ]
    )
    decision = joining(comm).join()
    assert (decision.action, decision.step) == (JOIN, 28)
    assert comm.restores == [(A, 28, ROLL_BACK_28), (B, 28, ROLL_BACK_28)]
    assert comm.join_ats == [0, 0, 30]


def test_a_joining_trainer_whose_roll_back_is_interrupted_asks_again():
    comm = ScriptedChannels(
        [
            {A: hello(11, 30), B: hello(99, 28, checkpoint_step=28)},
            {A: hello(11, 30), B: hello(99, 28, checkpoint_step=28)},  # A was unreachable: same decision
            {A: hello(11, 28, checkpoint_step=28), B: hello(99, 28, checkpoint_step=28)},
        ],
        restore_fails={A},
    )
    decision = joining(comm).join()
    assert (decision.action, decision.step) == (JOIN, 28)
    assert comm.restores == [(B, 28, ROLL_BACK_28), (A, 28, ROLL_BACK_28), (B, 28, ROLL_BACK_28)]


def test_a_joining_trainer_with_no_checkpoint_to_roll_back_to_fails_naming_it():
    comm = ScriptedChannels([{A: hello(11, 3), B: hello(99, 0)}] * 5)
    with pytest.raises(PserverError, match="stand at step 0 without a checkpoint at that step"):
        Recovery(comm, sync_mode=True, push_endpoints=[A, B], connect_timeout=5, recovery_timeout=0.15).join()
    assert comm.restores == []
