"""Trainer bookkeeping of the sync engine: heartbeat drops, rejoins mid-step, positions, roll-backs."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch
from torch import nn

from pserver.checkpoint.checkpointer import Checkpointer
from pserver.engine import AsyncEngine, FileWrites, Joined, ScheduledCheckpoints, SyncEngine
from pserver.errors import MustResync, NotAllowed
from pserver.rpc.prologue import status_of
from pserver.store import BlockStore
from pserver.tables.table_set import TableSet
from transpiler import DistributeTranspiler, DistributeTranspilerConfig, Program
from transpiler.position import Position

EP = "127.0.0.1:1"


def engine(trainers: int, checkpoint_dir=None, max_staleness=None) -> SyncEngine:
    torch.manual_seed(0)
    t = DistributeTranspiler(DistributeTranspilerConfig())
    t.transpile(
        0,
        program=Program(nn.Linear(4, 2), "sgd", lr=0.5),
        pservers=EP,
        trainers=trainers,
        sync_mode=max_staleness is None,
    )
    ps = t.get_pserver_program(EP)
    store, tables = BlockStore(ps, t.get_startup_program(EP, ps)), TableSet(ps)
    if max_staleness is not None:
        return AsyncEngine(store, tables, trainers, EP, barrier_timeout=5.0, max_staleness=max_staleness)
    checkpointer = (
        None if checkpoint_dir is None else Checkpointer(str(checkpoint_dir), store, tables, 0, 1, EP, True)
    )
    # Wired as ParameterServer wires them: the checkpointer also writes the scheduled checkpoints.
    listeners = [] if checkpointer is None else [ScheduledCheckpoints(checkpointer, FileWrites(), EP)]
    return SyncEngine(
        store, tables, trainers, EP, barrier_timeout=5.0, checkpointer=checkpointer, listeners=listeners
    )


def grads(e: SyncEngine, value: float):
    return {n: torch.full_like(b, value) for n, b in e.store.blocks.items()}


def weight(e: SyncEngine) -> torch.Tensor:
    return e.store.blocks["weight.block0"].detach().clone()


def checkpointed_at_step_1(checkpoint_dir) -> SyncEngine:
    """A sync engine of 2 trainers that both said Hello and pushed step 0, checkpointed at step 1."""
    e = engine(2, checkpoint_dir)
    for t in (0, 1):
        e.hello(t)
    for t in (0, 1):
        e.push(t, 0, grads(e, 1.0), position=(0, 1))
    e.checkpoint()
    return e


def test_silent_trainer_is_dropped_and_the_step_completes_without_it():
    e = engine(2)
    for t in (0, 1):
        e.hello(t)
    e.push(0, 0, grads(e, 1.0), position=(0, 1))
    assert e.step == 0  # waits for trainer 1
    e.roster.last_seen[1] -= 60  # trainer 1 fell silent a minute ago
    assert e.drop_silent(timeout=30) == [1]
    assert e.step == 1  # applied with trainer 0's gradient alone
    with pytest.raises(MustResync) as info:
        e.push(1, 1, grads(e, 1.0))
    assert status_of(info.value) == grpc.StatusCode.ABORTED and "dropped" in info.value.message
    assert e.drop_silent(timeout=30) == []  # trainer 0 is alive: never dropped


def test_trainer_rejoining_mid_step_counts_from_the_next_step():
    e = engine(3)
    for t in (0, 1, 2):
        e.hello(t)
    e.roster.last_seen[2] -= 60
    e.drop_silent(timeout=30)
    e.push(0, 0, grads(e, 1.0))  # step 0 in progress: trainer 1 missing
    assert e.hello(2)[:2] == (1, (0, 0))  # rejoins at step 1, not 0
    before = weight(e)
    e.push(1, 0, grads(e, 3.0))
    assert e.step == 1  # did not wait for trainer 2
    torch.testing.assert_close(weight(e), before - 0.5 * 2.0)  # mean of trainers 0 and 1
    e.push(0, 1, grads(e, 1.0))
    e.push(1, 1, grads(e, 1.0))
    assert e.step == 1  # step 1 waits for trainer 2 again
    e.push(2, 1, grads(e, 1.0))
    assert e.step == 2


def test_a_pserver_a_step_behind_finishes_its_step_without_a_trainer_joining_ahead():
    """Two pservers mid-step: p0 applied step 0 (trainer 1 was dropped), p1 still waits for it.

    Trainer 1 restarts and finds them apart (p0 says 1, p1 says 0). Waiting for them to agree while
    p1 waits for its push of step 0 would deadlock (its repeated Hellos keep it from being dropped):
    asked again with join_at=1, p1 finishes step 0 without it, and both then say step 1.
    """
    p0, p1 = engine(2), engine(2)
    for e in (p0, p1):
        for t in (0, 1):
            e.hello(t)
        e.roster.last_seen[1] -= 60
        e.drop_silent(timeout=30)
    p0.push(0, 0, grads(p0, 1.0))  # trainer 0's step 0 reached p0 first
    assert (p0.step, p1.step) == (1, 0)
    assert p0.hello(1)[0] == 1 and p1.hello(1)[0] == 0  # apart: the trainer waits and asks again
    assert p0.hello(1, join_at=1)[0] == 1 and p1.hello(1, join_at=1)[0] == 1
    p1.push(0, 0, grads(p1, 1.0))
    assert p1.step == 1  # did not wait for trainer 1
    for e in (p0, p1):  # from step 1 on, trainer 1 counts again
        e.push(0, 1, grads(e, 1.0))
        assert e.step == 1
        e.push(1, 1, grads(e, 1.0))
        assert e.step == 2


def test_a_join_a_step_ahead_completes_the_step_whose_other_pushes_are_all_in():
    """The pushes of the step in progress may all be in when a trainer says it joins a step later:
    no later push would complete the step (the others wait for it), so the Hello applies it."""
    e = engine(2)
    for t in (0, 1):
        e.hello(t)
    e.push(0, 0, grads(e, 1.0))
    assert e.step == 0  # waits for trainer 1
    before = weight(e)
    assert e.hello(1, join_at=1)[:2] == (1, (0, 0))  # applied at once, with trainer 0's gradient
    assert e.step == 1
    torch.testing.assert_close(weight(e), before - 0.5 * 1.0)
    e.push(0, 1, grads(e, 1.0))
    assert e.step == 1  # from step 1 on, trainer 1 counts again
    e.push(1, 1, grads(e, 1.0))
    assert e.step == 2


def test_hello_answers_one_view_of_the_trainer_and_the_step_in_progress():
    """Everything Hello reports comes from one hold of the engine's lock, as a Joined."""
    e = engine(2)
    assert e.hello(0) == Joined(
        step=0, position=(0, 0), applied_step=0, others_in_step=1, counted_step=-1, checkpoint_step=-1
    )
    e.hello(1)
    e.push(0, 0, grads(e, 1.0), position=Position(0, 1))
    e.push(1, 0, grads(e, 1.0), position=Position(0, 1))
    e.push(0, 1, grads(e, 1.0), position=Position(0, 2))
    # Trainer 0 says Hello again mid-step 1: its own push of step 1 is counted, trainer 1 is awaited.
    assert e.hello(0) == Joined(
        step=1, position=(0, 1), applied_step=1, others_in_step=1, counted_step=1, checkpoint_step=-1
    )


def test_step_in_progress_counts_the_other_trainers_in_it_and_shows_a_step_that_waits_for_nobody():
    """What Hello tells a joining trainer (applied_step, others_in_step): a step nobody else is in never
    completes."""
    e = engine(3)
    for t in (0, 1, 2):
        e.hello(t)
    assert e.step_in_progress(0) == (0, 2)  # trainers 1 and 2 expected
    e.push(1, 0, grads(e, 1.0))
    assert e.step_in_progress(0) == (0, 2)  # 1 counted, 2 expected
    assert e.step_in_progress(1) == (0, 2)  # itself not counted
    e.close(2)
    e.push(0, 0, grads(e, 1.0))
    assert e.step_in_progress(0) == (1, 1)  # applied; trainer 1 expected in step 1

    # All trainers down, both rejoin a step later: step 1 waits for nobody (stalled).
    stalled = engine(2)
    for t in (0, 1):
        assert stalled.hello(t, join_at=1)[:2] == (1, (0, 0))
    assert stalled.step == 0 and stalled.step_in_progress(0) == (0, 0)
    assert stalled.step_in_progress(1) == (0, 0)


def test_join_at_further_ahead_is_ignored():
    e = engine(2)
    for t in (0, 1):
        e.hello(t)
    assert e.hello(1, join_at=5)[:2] == (0, (0, 0))  # a roll-back's business, not a join's
    e.push(0, 0, grads(e, 1.0))
    assert e.step == 0  # still waits for trainer 1
    e.push(1, 0, grads(e, 1.0))
    assert e.step == 1


def test_positions_count_once_their_step_is_applied_and_return_at_hello():
    e = engine(2)
    e.push(0, 0, grads(e, 1.0), position=(0, 1))
    assert e.hello(0)[:2] == (0, (0, 0))  # step 0 not applied yet
    e.push(1, 0, grads(e, 1.0), position=(0, 1))
    e.push(0, 1, grads(e, 1.0), position=(1, 0))
    assert e.hello(0)[:2] == (1, (0, 1))


def test_restore_rolls_back_once_per_token_and_wakes_waiters(tmp_path):
    e = engine(1, tmp_path)
    e.hello(0)
    e.push(0, 0, grads(e, 1.0), position=(0, 1))
    at_1 = weight(e)
    e.checkpoint()
    e.push(0, 1, grads(e, 1.0), position=(0, 2))
    assert e.step == 2
    assert e.restore(0, 1, "ep#42") is True
    assert e.step == 1 and e.hello(0)[:2] == (1, (0, 1))
    torch.testing.assert_close(weight(e), at_1)
    e.push(0, 1, grads(e, 2.0))
    assert e.restore(0, 1, "ep#42") is False  # the same restart: no second roll-back
    assert e.step == 2
    with pytest.raises(NotAllowed) as info:
        e.restore(0, 7, "ep#43")
    assert status_of(info.value) == grpc.StatusCode.FAILED_PRECONDITION
    assert "no complete checkpoint" in info.value.message
    assert e.step == 2


def test_late_roll_back_to_the_checkpoint_a_pserver_stands_at_keeps_the_pushes_counted_since(tmp_path):
    """Seen under load in the chaos test: trainer 1 re-synced to checkpoint 1 and pushed step 1; a
    roll-back to the same checkpoint, asked later by trainer 0 for another restart, must not drop that
    push (the pservers would end a step apart and the job would wait for the barrier timeout)."""
    e = checkpointed_at_step_1(tmp_path)
    e.push(0, 1, grads(e, 1.0))
    assert e.restore(0, 1, "a#1") is True  # trainer 0 rolls back after a restart
    e.push(1, 1, grads(e, 1.0))  # trainer 1, already re-synced, pushes step 1
    assert e.restore(0, 1, "b#2") is False  # a late roll-back to the same checkpoint
    assert e.pending.trainers == {1} and e.step == 1
    e.push(0, 1, grads(e, 1.0))
    assert e.step == 2  # step 1 applied with both trainers' gradients
    e.push(0, 2, grads(e, 1.0))
    assert e.restore(0, 1, "c#3") is True and e.step == 1 and e.pending.trainers == set()  # a real roll-back


def test_late_roll_back_to_the_checkpoint_a_pserver_stands_at_waits_for_a_trainer_that_had_joined_later(
    tmp_path,
):
    """Seen in the chaos test (seed 1, in the full suite): restarted trainer 1 found the pservers apart
    (this one restarted at checkpoint 1, the other at step 2) and joined at step 2, so this one would
    finish step 1 without it. It then rolled the other back to checkpoint 1 and redoes step 1: here,
    step 1 must wait for it, or its push is stale ("pushed stale step 1; the pserver is at step 2")."""
    e = checkpointed_at_step_1(tmp_path)
    assert e.restore(0, 1, "a#1") is True  # back at checkpoint 1, as if restarted there
    assert e.hello(1, join_at=2)[0] == 2  # trainer 1 joins a step later: pservers apart
    assert e.restore(1, 1, "b#2") is False  # trainer 1 rolls every pserver back to 1
    e.push(0, 1, grads(e, 1.0))
    assert e.step == 1  # waits for trainer 1, which redoes step 1
    e.push(1, 1, grads(e, 3.0))
    assert e.step == 2 and e.last_step == {0: 1, 1: 1}


def test_a_failing_periodic_checkpoint_does_not_fail_the_step(tmp_path, caplog):
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")  # checkpoint_dir is a file: every write fails
    e = engine(1, blocked)
    e.checkpointer.every = 1
    e.hello(0)
    assert e.push(0, 0, grads(e, 1.0)) == (True, 1)  # applied, answered
    assert "checkpoint at step 1 failed" in caplog.text
    assert e.checkpointer.last is None


def test_async_trainer_held_back_by_a_dead_one_goes_on_once_it_is_dropped():
    e = engine(2, max_staleness=1)
    for t in (0, 1):
        e.hello(t)
    e.push(1, 0, grads(e, 1.0))
    e.push(0, 0, grads(e, 1.0))
    e.push(0, 1, grads(e, 1.0))
    e.push(0, 2, grads(e, 1.0))
    result = {}
    waiter = threading.Thread(target=lambda: result.setdefault("push", e.push(0, 3, grads(e, 1.0))))
    waiter.start()  # step 3 is 2 ahead of trainer 1's next: waits
    waiter.join(0.3)
    assert waiter.is_alive() and e.step == 4
    e.roster.last_seen[1] -= 60  # trainer 1 died
    assert e.drop_silent(timeout=30) == [1]
    waiter.join(5)
    assert result["push"] == (True, 5)


# (case, dropped at, rejoined?, closed?, now, expected abandoned ids) with a 100 s rejoin timeout
ABANDONED = [
    ("dropped 50 s ago: may still rejoin", {1: 950.0}, set(), set(), 1000.0, []),
    ("dropped 150 s ago, never back: abandoned", {1: 850.0}, set(), set(), 1000.0, [1]),
    ("dropped long ago but rejoined since", {1: 0.0}, {1}, set(), 1000.0, []),
    ("dropped long ago, then closed", {1: 0.0}, set(), {1}, 1000.0, []),
    ("two dropped, one long enough", {1: 850.0, 2: 990.0}, set(), set(), 1000.0, [1]),
]


@pytest.mark.parametrize(
    "case, dropped_at, rejoined, closed, now, expected", ABANDONED, ids=[row[0] for row in ABANDONED]
)
def test_roster_abandoned_trainers(case, dropped_at, rejoined, closed, now, expected):
    from pserver.engine.roster import Roster

    r = Roster(3)
    for t, at in dropped_at.items():
        r.join(t)
        r.drop(t, at)
    for t in rejoined:
        r.join(t)
    for t in closed:
        r.close(t)
    assert [t for t, _ in r.abandoned(100.0, now)] == expected


def test_dropped_trainer_that_never_rejoins_is_counted_closed_and_the_job_ends(caplog):
    e = engine(2)
    for t in (0, 1):
        e.hello(t)
    e.roster.last_seen[1] -= 60  # trainer 1 died
    assert e.drop_silent(timeout=30, rejoin_timeout=100) == [1]
    assert e.close(0) == 1 and not e.all_closed.is_set()  # trainer 1 may still come back
    e.roster.dropped_at[1] -= 101  # ... but did not, within trainer_rejoin_timeout
    e.drop_silent(timeout=30, rejoin_timeout=100)
    assert e.all_closed.is_set() and e.roster.closed == {0, 1}
    assert "trainer 1 was dropped" in caplog.text and "counted as closed" in caplog.text
    assert e.hello(1)[0] == e.step and 1 not in e.roster.closed  # a late restart still rejoins


def test_a_wait_from_before_a_roll_back_is_refused_at_once_instead_of_deadlocking(tmp_path):
    """Seen in the chaos test: trainer 1 said Hello at step 2, then trainer 0 rolled the pserver back to
    the checkpoint at step 1; trainer 1's pull waiting for update 2 would wait for a step that needs its
    own push, until the barrier deadline. It is told to re-sync instead; after its Hello it waits normally."""
    e = checkpointed_at_step_1(tmp_path)
    for t in (0, 1):
        e.push(t, 1, grads(e, 1.0), position=(0, 2))
    assert e.hello(1)[:2] == (2, (0, 2))  # trainer 1 (re)joins at step 2
    assert e.restore(0, 1, "ps0#7") is True and e.step == 1
    e.hello(0)
    with pytest.raises(MustResync) as info:
        e.wait_for_step(1, 2)  # would need trainer 1's own push of step 1
    assert (
        status_of(info.value) == grpc.StatusCode.ABORTED
        and "since trainer 1 said Hello" in info.value.message
    )
    e.wait_for_step(1, 1)  # what stands is served: nothing to wait for
    assert e.hello(1)[:2] == (1, (0, 1))  # re-synced: step 1 from the checkpoint
    for t in (0, 1):
        e.push(t, 1, grads(e, 1.0), position=(0, 2))
    e.wait_for_step(1, 2)
    assert e.step == 2


def test_a_trainer_from_before_a_roll_back_that_pushed_the_step_waits_for_it_as_usual(tmp_path):
    """Its push of the step after the roll-back was counted: refusing its wait would make it push the
    step again after the others completed it (a stale push)."""
    e = checkpointed_at_step_1(tmp_path)
    e.push(0, 1, grads(e, 1.0), position=(0, 2))
    assert e.restore(0, 1, "ps0#8") is True
    e.hello(0)
    e.push(1, 1, grads(e, 1.0), position=(0, 2))  # trainer 1 (Hello before the roll-back) pushes step 1
    outcome = []

    def wait():
        try:
            e.wait_for_step(1, 2)
            outcome.append("served")
        except MustResync as refused:
            outcome.append(refused)

    waited = threading.Thread(target=wait)
    waited.start()
    e.push(0, 1, grads(e, 1.0), position=(0, 2))
    waited.join(timeout=5)
    assert outcome == ["served"] and e.step == 2


def test_a_roll_back_to_the_checkpoint_a_pserver_stands_at_refuses_waits_of_trainers_told_to_join_later(
    tmp_path,
):
    """A joining trainer's roll-back reaches a pserver already at the checkpoint: it keeps what it counted,
    but a trainer it had told to start a step later is expected in this step again, so that trainer's wait
    from before (for the later step) is refused at once instead of waiting for its own push until
    barrier_timeout."""
    e = checkpointed_at_step_1(tmp_path)
    assert e.restore(0, 1, "restart") is True and e.step == 1  # resumed from it: nothing applied since
    for t in (0, 1):
        e.hello(t, join_at=2)  # both told to start at step 2
    assert e.step_in_progress(0) == (1, 0)  # stalled: waits for nobody
    assert e.restore(1, 1, "join") is False and e.step == 1  # kept, but the join steps are forgotten
    assert e.step_in_progress(0) == (1, 1)
    with pytest.raises(
        MustResync, match="rolled back to the checkpoint at step 1 since trainer 0 said Hello"
    ):
        e.wait_for_step(0, 2)
    e.hello(0)
    e.push(0, 1, grads(e, 1.0))
    e.push(1, 1, grads(e, 1.0))
    assert e.step == 2  # step 1 redone with both trainers


def test_stats_is_the_state_stats_and_metrics_report(tmp_path):
    """One value for ps-stat and /metrics: step, trainers by state, what is stored, the latest checkpoint."""
    e = checkpointed_at_step_1(tmp_path)
    e.close(1)
    snap = e.stats()
    assert (snap.step, snap.sync_mode, snap.trainers) == (1, True, 2)
    assert (snap.alive, snap.dropped, snap.closed) == ((0,), (), (1,))
    assert (snap.blocks, snap.block_bytes) == (len(e.store.blocks), e.store.nbytes) and snap.blocks > 0
    assert (snap.table_rows, snap.table_bytes) == (0, 0)
    assert snap.checkpoint.step == 1 and snap.checkpoint.path.endswith("pserver-0-of-1")
    assert snap.checkpoint == e.checkpointer.last


def test_a_trainer_whose_push_is_parked_is_not_silent_and_is_heard_from_when_released():
    e = engine(3)
    for t in (0, 1, 2):
        e.hello(t)
    e.push(0, 0, grads(e, 1.0))
    e.push(1, 0, grads(e, 1.0))
    handle = e.park_for_step(0, 1)  # trainer 0's answer waits for trainer 2's push
    assert handle is not None and not handle.done and e.waits.parked_trainers() == {0}
    e.roster.last_seen[0] -= 60  # its push arrived a minute ago, and it still waits
    e.roster.last_seen[1] -= 60  # trainer 1 pushed then, and holds no call here
    assert e.drop_silent(timeout=30) == [1]  # trainer 0 is held by this pserver, not silent
    # A second process saying Hello for trainer 0 finds it heard from now: the id's holder is alive.
    assert e.presence(0)[0] > time.monotonic() - 5 and e.presence(1)[0] < time.monotonic() - 59
    e.push(2, 0, grads(e, 1.0))
    assert handle.done and handle.error is None and e.waits.parked_trainers() == set()
    # Released just now: heard from at the step's end, not at its push a minute ago.
    assert e.presence(0)[0] > time.monotonic() - 5
    assert e.drop_silent(timeout=30) == []
