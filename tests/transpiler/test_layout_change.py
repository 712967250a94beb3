"""A change of pserver count, planned: the next layout's plans (as a transpile for that many pservers
would cut and place the blocks, a new epoch and digest), what it moves, and the refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from transpiler import DistributeTranspiler, DistributeTranspilerConfig, Program
from transpiler.layout.change import next_pserver_program, next_trainer_program
from transpiler.layout.change_checks import LayoutChangeRefused, check_change, check_fit
from transpiler.layout.moves import block_pieces, moved_slot_fraction, piece_bytes, slots_between
from transpiler.plans import PserverProgram, TrainerProgram

EPS = ["127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:7003", "127.0.0.1:7004", "127.0.0.1:7005"]


def program() -> Program:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(100, 8, sparse=True), nn.Linear(8, 4096), nn.Linear(4096, 3))
    return Program(model, "adam", lr=0.01, distributed_tables=["0"])


def transpiled(pservers, **config):
    t = DistributeTranspiler(DistributeTranspilerConfig(min_block_size=8192, **config))
    t.transpile(0, program=program(), pservers=",".join(pservers), trainers=2, sync_mode=True)
    return t


@pytest.mark.parametrize(
    "now, nxt, split_method",
    [
        (2, 3, "RoundRobin"),
        (3, 2, "RoundRobin"),
        (4, 5, "HashName"),
        (1, 2, "RoundRobin"),
        (2, 1, "HashName"),
    ],
)
def test_the_next_plans_cut_and_place_blocks_as_a_transpile_for_that_many_pservers(now, nxt, split_method):
    old = transpiled(EPS[:now], split_method=split_method)
    fresh = transpiled(EPS[:nxt], split_method=split_method)
    trainer = next_trainer_program(old.get_trainer_program(), EPS[:nxt])
    assert trainer.params == fresh.get_trainer_program().params
    assert trainer.pservers == EPS[:nxt] and trainer.layout_epoch == 1
    # The epoch is in the digest: a trainer of the old layout is told apart from one of the next.
    assert trainer.layout_digest not in (old.get_trainer_program().layout_digest, fresh._digest)
    for ep in EPS[:nxt]:
        ps = next_pserver_program(old.get_pserver_program(EPS[0]), EPS[:nxt], ep)
        want = fresh.get_pserver_program(ep)
        assert (ps.endpoint, ps.blocks, ps.params, ps.pservers) == (
            ep,
            want.blocks,
            want.params,
            want.pservers,
        )
        assert (ps.layout_epoch, ps.layout_digest) == (1, trainer.layout_digest)
        assert PserverProgram.from_bytes(ps.to_bytes()) == ps
    assert TrainerProgram.from_bytes(trainer.to_bytes()) == dataclasses.replace(trainer, model=None)
    back = next_trainer_program(trainer, EPS[:now])
    assert back.params == old.get_trainer_program().params and back.layout_epoch == 2


@pytest.mark.parametrize(
    "nxt, in_progress, message",
    [
        ([], None, "at least one pserver; asked for 0"),
        (EPS[:2], None, "already runs on these 2 pservers"),
        (EPS[:3], 4, "a change to layout epoch 4 is in progress"),
        ([EPS[0], EPS[2], EPS[0]], None, "listed more than once"),
    ],
)
def test_a_bad_change_is_refused_with_its_reason(nxt, in_progress, message):
    with pytest.raises(LayoutChangeRefused, match=message):
        check_change(EPS[:2], nxt, 3, in_progress)


@pytest.mark.parametrize(
    "nxt, message",
    [
        ([], "at least one pserver; asked for 0"),
        ("", "at least one pserver; asked for 0"),
        (["nohost"], "not of the form host:port"),
        (EPS[:2], "already runs"),
    ],
)
def test_the_next_plans_refuse_a_bad_pserver_list_and_change_nothing(nxt, message):
    t = transpiled(EPS[:2])
    trainer, ps = t.get_trainer_program(), t.get_pserver_program(EPS[0])
    before = (trainer.to_bytes(), ps.to_bytes())
    with pytest.raises(LayoutChangeRefused, match=message):
        next_trainer_program(trainer, nxt)
    with pytest.raises(LayoutChangeRefused, match=message):
        next_pserver_program(ps, nxt, EPS[0])
    assert (trainer.to_bytes(), ps.to_bytes()) == before


def test_a_plan_of_a_pserver_not_in_the_next_list_or_without_the_whole_layout_is_refused():
    ps = transpiled(EPS[:2]).get_pserver_program(EPS[0])
    with pytest.raises(LayoutChangeRefused, match="not one of the next pservers"):
        next_pserver_program(ps, EPS[1:3], EPS[0])
    with pytest.raises(LayoutChangeRefused, match="made before layouts could change"):
        next_pserver_program(dataclasses.replace(ps, params=[]), EPS[:3], EPS[2])


def test_with_hot_standby_every_new_pserver_comes_with_its_backup():
    backups = ["127.0.0.1:7101", "127.0.0.1:7102", "127.0.0.1:7103"]
    t = transpiled(
        EPS[:2],
        server_replicas=2,
        replica_endpoints=",".join(backups[:2]),
        coordinator="http://127.0.0.1:2379",
    )
    with pytest.raises(LayoutChangeRefused, match="give 3 replica endpoints"):
        next_trainer_program(t.get_trainer_program(), EPS[:3])
    with pytest.raises(LayoutChangeRefused, match="more than once"):
        next_trainer_program(t.get_trainer_program(), EPS[:3], [backups[0], backups[1], EPS[0]])
    trainer = next_trainer_program(t.get_trainer_program(), EPS[:3], backups)
    assert trainer.replica_groups[EPS[2]] == [EPS[2], backups[2]]
    ps = next_pserver_program(t.get_pserver_program(backups[0]), EPS[:3], backups[2], backups)
    assert ps.shard == 2 and ps.blocks == [b for b in trainer.blocks if b.endpoint == EPS[2]]


@pytest.mark.parametrize(
    "state, free, nxt, message",
    [
        ({"a": 600, "b": 600}, {"a": 10**6, "b": 10**6, "c": 10**6}, ["a", "b", "c"], None),
        ({"a": 600, "b": 600}, {"a": 10**6, "b": 10**6, "c": 100}, ["a", "b", "c"], "c would take 400 bytes"),
        ({"a": 600, "b": 600}, {"a": 10**6}, ["a"], None),
        ({"a": 600, "b": 600}, {"a": 10**6}, ["a", "b", "c"], None),  # b and c: not known, not checked
        ({"a": 600, "b": 600}, {"a": 700}, ["a"], "a would take 600 bytes with 560 to spare"),
    ],
)
def test_a_count_the_state_cannot_fit_is_refused(state, free, nxt, message):
    if message is None:
        check_fit(state, free, nxt)
    else:
        with pytest.raises(LayoutChangeRefused, match=message):
            check_fit(state, free, nxt)


@pytest.mark.parametrize("now, nxt", [(1, 2), (2, 3), (3, 2), (4, 5), (5, 4), (7, 8)])
def test_a_change_by_one_pserver_moves_only_that_pserver_s_share(now, nxt):
    pairs = slots_between(now, nxt)
    gone_or_new = max(now, nxt) - 1
    assert all(gone_or_new in pair for pair in pairs)  # every moved slot comes from or goes to it
    fraction = moved_slot_fraction(now, nxt)
    assert abs(fraction - 1 / max(now, nxt)) < 0.05 / max(now, nxt)
    assert sum(s.size for s in pairs.values()) == round(fraction * 16384)


def test_the_dense_move_lists_the_rows_each_new_block_takes_from_another_pserver():
    old = transpiled(EPS[:2]).get_trainer_program()
    nxt = next_trainer_program(old, EPS[:3])
    pieces = block_pieces(old.params, nxt.params)
    # Every row of every next block is either already on its pserver or in exactly one piece.
    for p_old, p_next in zip(old.params, nxt.params):
        for b in p_next.blocks:
            here = sum(
                min(b.row_end, o.row_end) - max(b.row_start, o.row_start)
                for o in p_old.blocks
                if o.endpoint == b.endpoint and min(b.row_end, o.row_end) > max(b.row_start, o.row_start)
            )
            moved = sum(x.row_end - x.row_start for x in pieces if x.block == b.name)
            assert here + moved == b.row_end - b.row_start
    assert all(x.source_pserver != x.to for x in pieces)
    assert piece_bytes(pieces, nxt.params) > 0
    assert block_pieces(old.params, old.params) == []
