"""The modes' push handlers (pserver/engine/modes/): their decisions, table by table, then on a real engine.

The pure decisions first (a push's step against the pserver's, a dropped push, who a sync step waits for,
the slowest trainer and the staleness bound, what each mode refuses of a push's header), then each handler
as ``for_plan`` picks it from a transpiled plan and the engine calls it: the step an answer waits for,
reads, backup trainers' step sets and dropped pushes, GEO's scaled deltas.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pserver.engine import Engine
from pserver.engine.modes import AsyncMode, GeoMode, SyncMode, for_plan
from pserver.engine.modes.asynchronous import fresh_enough, slowest
from pserver.engine.modes.backup_steps import dropped_arrival
from pserver.engine.modes.mode import Arrival
from pserver.engine.modes.sync import counted_arrival
from pserver.engine.pending import PendingStep
from pserver.errors import BadRequest, MustResync, NotAllowed
from pserver.store import BlockStore
from pserver.tables.table_set import TableSet
from transpiler import DistributeTranspiler, DistributeTranspilerConfig, Program

EP = "127.0.0.1:1"
NEW, DUPLICATE, STALE, AHEAD = Arrival.NEW, Arrival.DUPLICATE, Arrival.STALE, Arrival.AHEAD


def engine(trainers: int = 2, sync: bool = True, **config) -> Engine:
    """An engine of one pserver for ``trainers`` trainers, its mode's handler picked from the plan as the
    pserver picks it (``config``: DistributeTranspilerConfig's fields, e.g. k_steps)."""
    torch.manual_seed(0)
    t = DistributeTranspiler(DistributeTranspilerConfig(**config))
    t.transpile(
        0, program=Program(nn.Linear(4, 2), "sgd", lr=0.5), pservers=EP, trainers=trainers, sync_mode=sync
    )
    ps = t.get_pserver_program(EP)
    store, tables = BlockStore(ps, t.get_startup_program(EP, ps)), TableSet(ps)
    e = Engine(store, tables, trainers, EP, barrier_timeout=5.0, mode=for_plan(ps))
    for trainer_id in range(trainers):
        e.hello(trainer_id)
    return e


def grads(e: Engine, value: float):
    return {n: torch.full_like(b, value) for n, b in e.store.blocks.items()}


def weight(e: Engine) -> torch.Tensor:
    return e.store.blocks["weight.block0"].detach().clone()


# -- the pure decisions -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "step, pserver_step, counted, last_counted, arrival",
    [
        (0, 0, False, -1, NEW),  # a first push
        (3, 3, False, 2, NEW),
        (3, 3, True, 3, DUPLICATE),  # retried while its step is in progress
        (2, 3, False, 2, DUPLICATE),  # retried after its step applied
        (2, 3, False, 1, STALE),  # a step applied without it
        (2, 3, False, -1, STALE),
        (4, 3, False, 3, AHEAD),
        (3, 3, False, 5, NEW),  # counted further once, on a timeline a roll-back kept the step of
    ],
)
def test_a_sync_push_is_new_duplicate_stale_or_ahead(step, pserver_step, counted, last_counted, arrival):
    assert counted_arrival(step, pserver_step, counted, last_counted) is arrival


@pytest.mark.parametrize(
    "step, pserver_step, counted, arrival",
    [
        (3, 3, False, NEW),  # leaves the step in progress
        (3, 3, True, DUPLICATE),  # its gradients count in the step already: only acknowledged
        (2, 3, False, DUPLICATE),  # a past step's, retried: acknowledged
        (4, 3, False, AHEAD),
    ],
)
def test_a_dropped_push_leaves_its_step_or_is_acknowledged_or_refused(step, pserver_step, counted, arrival):
    assert dropped_arrival(step, pserver_step, counted) is arrival


@pytest.mark.parametrize(
    "live, joins_later, dropped, admitted, expected",
    [
        ({0, 1, 2}, {}, (), None, {0, 1, 2}),  # every live trainer
        ({0, 2}, {}, (), None, {0, 2}),  # trainer 1 closed or was dropped
        ({0, 1, 2}, {2: 1}, (), None, {0, 1}),  # trainer 2 joins at step 1
        ({0, 1, 2}, {2: 0}, (), None, {0, 1, 2}),  # told step 0 while the pserver is at 0: counts
        ({0, 1, 2}, {}, (), (0, 1), {0, 1}),  # backup trainers: the step is made of trainers 0 and 1
        ({0, 1, 2}, {}, (2,), None, {0, 1}),  # trainer 2 pushed the step dropped
        ({0, 2}, {}, (), (0, 1), {0}),  # of the step's trainers, the live ones
    ],
)
def test_who_a_sync_step_waits_for(live, joins_later, dropped, admitted, expected):
    pending = PendingStep()
    for trainer_id, step in joins_later.items():
        pending.join_later(trainer_id, step)
    for trainer_id in dropped:
        pending.drop(trainer_id, (0, 0))
    if admitted is not None:
        assert pending.admit(frozenset(admitted))
    assert pending.expected(live, 0) == expected


@pytest.mark.parametrize(
    "first, then, agrees",
    [((0, 1), (0, 1), True), ((0, 1), (1, 0), True), ((0, 1), (0, 2), False), ((0, 1), (0, 1, 2), False)],
)
def test_a_step_is_made_of_the_trainers_its_first_push_named(first, then, agrees):
    pending = PendingStep()
    assert pending.admit(frozenset(first))
    assert pending.admit(frozenset(then)) is agrees
    assert pending.admitted == frozenset(first)


@pytest.mark.parametrize(
    "others, last_step, expected",
    [
        (set(), {}, (None, [])),  # alone: nobody to wait for
        ({1, 2}, {1: 4, 2: 2}, (3, [2])),
        ({1, 2}, {1: 2, 2: 2}, (3, [1, 2])),
        ({1, 2, 3}, {1: 2, 2: 2}, (0, [3])),  # trainer 3 never pushed: its next step is 0
    ],
)
def test_the_slowest_trainer_is_the_lowest_next_step(others, last_step, expected):
    assert slowest(others, last_step) == expected


@pytest.mark.parametrize(
    "step, slowest_step, max_staleness, fresh",
    [
        (10, None, 0, True),  # no other trainer
        (3, 3, 0, True),
        (4, 3, 0, False),
        (5, 3, 2, True),
        (6, 3, 2, False),
        (1, 3, 2, True),  # behind the slowest other
    ],
)
def test_a_push_waits_past_max_staleness(step, slowest_step, max_staleness, fresh):
    assert fresh_enough(step, slowest_step, max_staleness) is fresh


MODES = {
    "sync": dict(sync=True),
    "async": dict(sync=False),
    "geo": dict(sync=False, k_steps=4),
}


@pytest.mark.parametrize(
    "mode, step_trainers, dropped, carries, refused",
    [
        ("sync", (), False, True, False),
        ("sync", (0, 1), False, True, False),  # backup trainers: the step's trainers
        ("sync", (0, 1), True, False, False),  # left out of its step
        ("sync", (), True, True, True),  # a dropped push has no gradients to give
        ("sync", (0, 1), True, True, True),
        ("async", (), False, True, False),
        ("async", (0, 1), False, True, True),  # only a sync step is made of named trainers
        ("async", (), True, False, True),
        ("geo", (), False, True, False),
        ("geo", (0,), False, True, True),
        ("geo", (), True, False, True),
    ],
)
def test_what_each_mode_refuses_of_a_push_before_it_counts(mode, step_trainers, dropped, carries, refused):
    e = engine(**MODES[mode])
    grads_ = grads(e, 1.0) if carries else {}
    if refused:
        with pytest.raises(BadRequest, match=r"a push with step_trainers or dropped is a sync step's"):
            e.mode.check_push(step_trainers, dropped, grads_, {})
    else:
        e.mode.check_push(step_trainers, dropped, grads_, {})


# -- the handlers as the plan picks them ------------------------------------------------------------------


@pytest.mark.parametrize(
    "mode, config, kind, sync, answer_step, reads_copy",
    [
        ("sync", {}, SyncMode, True, 8, False),
        ("async", {}, AsyncMode, False, 0, True),
        ("bounded", dict(max_staleness=2), AsyncMode, False, 0, True),
        ("geo", dict(k_steps=4), GeoMode, False, 0, True),
    ],
)
def test_the_plan_picks_the_handler(mode, config, kind, sync, answer_step, reads_copy):
    e = engine(4, sync=mode == "sync", **config)
    assert type(e.mode) is kind
    assert e.sync_mode is sync and e.mode.sync is sync
    assert e.mode.answer_step(7) == answer_step  # a push of step 7's answer waits for 8 updates (sync)
    assert e.mode.reads_need_copy is reads_copy
    assert (e.pending is not None) is sync and e.pending is e.mode.pending
    if kind is AsyncMode:
        assert e.mode.max_staleness == config.get("max_staleness")
    if kind is GeoMode:
        assert e.mode.scale == 0.25 and e.mode.max_staleness is None


def test_a_step_made_of_other_trainers_than_its_first_push_named_is_refused():
    e = engine(3)
    assert e.push(0, 0, grads(e, 1.0), step_trainers=(0, 1)) == (True, 0)
    with pytest.raises(
        NotAllowed, match=r"trainer 1 pushed step 0 as made of trainers \[0, 2\], but the step is "
    ):
        e.push(1, 0, grads(e, 1.0), step_trainers=(2, 0))
    assert e.counted_step(1) == -1 and e.step == 0  # nothing counted
    assert e.push(1, 0, grads(e, 3.0), step_trainers=(1, 0)) == (True, 1)  # trainer 2 is no step of it


def test_a_dropped_push_lets_its_step_apply_without_it_and_keeps_its_position():
    e = engine(3)
    before = weight(e)
    e.push(0, 0, grads(e, 1.0), step_trainers=(0, 1))
    e.push(1, 0, grads(e, 3.0), position=(0, 5), step_trainers=(0, 1))
    assert e.step == 1  # made of trainers 0 and 1: trainer 2 is not waited for
    torch.testing.assert_close(weight(e), before - 0.5 * 2.0)
    assert e.push(2, 0, {}, position=(0, 4), dropped=True) == (False, 1)  # a past step's: acknowledged
    assert e.counted_step(2) == 0
    e.push(0, 1, grads(e, 1.0))
    e.push(1, 1, grads(e, 1.0))
    assert e.step == 1  # no step set named: waits for trainer 2 ...
    assert e.push(2, 1, {}, position=(0, 9), dropped=True) == (False, 2)  # ... which leaves the step
    assert e.roster.positions[2] == (0, 9) and e.counted_step(2) == 1
    assert e.push(2, 1, {}, dropped=True) == (False, 2)  # retried: acknowledged
    with pytest.raises((NotAllowed, MustResync), match="pushed step 3"):
        e.push(2, 3, {}, dropped=True)


def test_sync_duplicates_are_acknowledged_and_stale_or_ahead_pushes_refused():
    e = engine(2)
    assert e.push(0, 0, grads(e, 1.0)) == (True, 0)
    assert e.push(0, 0, grads(e, 1.0)) == (False, 0)  # retried while its step is in progress
    assert e.push(1, 0, grads(e, 1.0)) == (True, 1)
    assert e.push(1, 0, grads(e, 1.0)) == (False, 1)  # retried after the step applied
    with pytest.raises(NotAllowed, match="pushed step 5"):
        e.push(0, 5, grads(e, 1.0))
    e.push(0, 1, grads(e, 1.0))
    e.roster.last_seen[1] -= 60  # trainer 1 fell silent: step 1 applies without it
    assert e.drop_silent(timeout=30) == [1] and e.step == 2
    e.hello(1)
    with pytest.raises(NotAllowed, match="trainer 1 pushed stale step 1; the pserver is at step 2"):
        e.push(1, 1, grads(e, 1.0))


def test_async_applies_each_push_on_arrival_once():
    e = engine(2, sync=False)
    before = weight(e)
    assert e.push(0, 0, grads(e, 1.0), position=(0, 1)) == (True, 1)
    assert e.push(0, 0, grads(e, 1.0)) == (False, 1)  # a retry
    assert e.push(1, 0, grads(e, 2.0)) == (True, 2)
    torch.testing.assert_close(weight(e), before - 0.5 * 3.0)
    assert e.roster.positions[0] == (0, 1)
    assert e.park_for_step(0, 5) is None  # an async answer never waits


def test_geo_adds_each_push_as_its_delta_divided_by_the_trainers():
    e = engine(4, sync=False, k_steps=2)
    expected = weight(e)
    for trainer_id, delta in ((0, 1.0), (1, -3.0)):
        assert e.push(trainer_id, 0, grads(e, delta)) == (True, trainer_id + 1)
        expected.add_(torch.full_like(expected, delta), alpha=0.25)
    assert torch.equal(weight(e), expected)
    assert e.store.block_state("weight.block0") == {}  # no optimizer on the pserver


@pytest.mark.parametrize("mode, moved", [("sync", -0.5 * 2.0), ("async", -0.5 * 2.0), ("geo", 2.0 / 4)])
def test_a_backup_applies_its_primarys_update_as_its_mode_applies_a_push(mode, moved):
    """Hot standby: the primary's update (its mean gradient, or GEO's delta) through the same handler."""
    e = engine(4, **MODES[mode])
    start = weight(e)
    e.apply_replicated(0, 1, {"trainers": {"0": {"last_step": 0, "position": [0, 3]}}}, grads(e, 2.0), {})
    assert e.step == 1 and e.counted_step(0) == 0
    torch.testing.assert_close(weight(e), start + moved)
