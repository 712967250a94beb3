"""The contract the servicer talks to: what a push, pull or prefetch may carry (Contents), and the engine's
hooks.

The servicer reaches blocks and tables only through these methods, so each is checked here on a real engine
and its contents over a plan with dense blocks and two distributed tables sharded over two pservers.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from pserver.checkpoint.checkpointer import Checkpointer
from pserver.engine import AsyncEngine, Contents, FileWrites, PushParts, ScheduledCheckpoints, SyncEngine
from pserver.errors import BadRequest, MustResync, NotAllowed
from pserver.store import BlockStore
from pserver.tables.table_set import TableSet
from tests.helpers.table_models import BAG_DIM, DIM, table_program
from transpiler import DistributeTranspiler, DistributeTranspilerConfig
from transpiler.tables import shard_of

EPS = ["127.0.0.1:1", "127.0.0.1:2"]


def engine(sync: bool = True, trainers: int = 2, checkpoint_dir=None, pservers: int = 2, **hooks):
    """Pserver 0 of ``pservers``'s engine for ``trainers`` trainers: its blocks, shard 0 of tables emb and
    bag."""
    t = DistributeTranspiler(DistributeTranspilerConfig(slice_var_up=False))
    t.transpile(
        0,
        program=table_program("sgd", lr=0.5),
        pservers=",".join(EPS[:pservers]),
        trainers=trainers,
        sync_mode=sync,
    )
    ps = t.get_pserver_program(EPS[0])
    store, tables = BlockStore(ps, t.get_startup_program(EPS[0], ps)), TableSet(ps)
    checkpointer = (
        None
        if checkpoint_dir is None
        else Checkpointer(str(checkpoint_dir), store, tables, 0, pservers, EPS[0], sync)
    )
    cls = SyncEngine if sync else AsyncEngine
    # Wired as ParameterServer wires them: the checkpointer also writes the scheduled checkpoints.
    listeners = [] if checkpointer is None else [ScheduledCheckpoints(checkpointer, FileWrites(), EPS[0])]
    return cls(
        store,
        tables,
        trainers,
        EPS[0],
        barrier_timeout=5.0,
        checkpointer=checkpointer,
        listeners=listeners,
        **hooks,
    )


def contents() -> Contents:
    """What pserver 0's requests may carry: its engine's blocks and table shards."""
    e = engine()
    return Contents(e.store, e.tables)


def ids_of(shard: int, n: int = 4) -> np.ndarray:
    """``n`` distinct ids that belong to ``shard`` of 2."""
    candidates = np.arange(-50, 50, dtype=np.int64)
    return candidates[shard_of(candidates, 2) == shard][:n]


def test_block_names_and_layout_are_the_blocks_this_pserver_owns():
    e = contents()
    names = e.block_names()
    assert sorted(names) == sorted(e.store.blocks) and names  # RoundRobin gave pserver 0 some blocks
    layout = e.block_layout()
    assert list(layout) == list(names)
    for name, (dtype, shape) in layout.items():
        assert (dtype, list(shape)) == (e.store.blocks[name].dtype, list(e.store.blocks[name].shape))
        assert dtype == torch.float32
    assert "emb@ids" not in names and "no.such.block" not in names


def test_expect_names_what_a_push_may_carry_and_expect_table_what_a_prefetch_may():
    e = contents()
    block = next(iter(e.block_names()))
    assert e.expect(block) == ("float32", list(e.store.blocks[block].shape))
    assert e.expect("emb@ids") == ("int64", [-1])
    assert e.expect("emb@rows") == ("float32", [-1, DIM])
    assert e.expect("bag@rows") == ("float32", [-1, BAG_DIM])
    assert e.expect("bag@next") == ("int64", [-1])
    assert e.expect("emb") is None and e.expect("nope@ids") is None and e.expect("") is None
    assert e.expect_table("emb@ids") == ("int64", [-1])
    assert e.expect_table(block) is None  # a dense block is unknown in a prefetch


def test_sort_push_sorts_dense_sparse_and_the_ids_the_answer_carries_rows_of():
    e = contents()
    block = next(iter(e.block_names()))
    ids = ids_of(0, 3)
    pushed_ids = torch.from_numpy(np.concatenate([ids, ids[:1]]))  # ids[0] twice: summed
    rows = torch.arange(4 * DIM, dtype=torch.float32).reshape(4, DIM)
    ahead = torch.from_numpy(ids_of(0, 2))
    grad = torch.ones(e.store.blocks[block].shape)
    parts = e.sort_push({block: grad, "emb@ids": pushed_ids, "emb@rows": rows, "bag@next": ahead})
    assert isinstance(parts, PushParts)
    assert list(parts.dense) == [block] and parts.dense[block] is grad
    got_ids, got_rows = parts.sparse["emb"]
    order = np.argsort(got_ids)
    assert got_ids[order].tolist() == sorted(ids.tolist())
    by_id = dict(zip(got_ids.tolist(), got_rows.tolist()))
    assert by_id[int(ids[0])] == (rows[0] + rows[3]).tolist() and by_id[int(ids[1])] == rows[1].tolist()
    assert list(parts.sparse) == ["emb"]
    assert {t: v.tolist() for t, v in parts.answer_ids.items()} == {"bag": ahead.tolist()}


@pytest.mark.parametrize(
    "tensors, match",
    [
        (lambda: {"emb@ids": torch.from_numpy(ids_of(0, 2))}, "needs both 'emb@ids' and 'emb@rows'"),
        (lambda: {"emb@ids": torch.from_numpy(ids_of(0, 2)), "emb@rows": torch.zeros(3, DIM)}, "2 ids but 3"),
        (
            lambda: {"emb@ids": torch.from_numpy(ids_of(1, 2)), "emb@rows": torch.zeros(2, DIM)},
            "do not belong to shard 0 of 2",
        ),
        (lambda: {"bag@next": torch.from_numpy(ids_of(1, 1))}, "do not belong to shard 0 of 2"),
    ],
)
def test_sort_push_refuses_unpaired_or_misrouted_sparse_tensors(tensors, match):
    with pytest.raises(BadRequest, match=match):
        contents().sort_push(tensors())


def test_prefetch_ids_are_checked_and_carry_nothing_else():
    e = contents()
    ids = ids_of(0, 3)
    got = e.prefetch_ids({"emb@ids": torch.from_numpy(ids), "bag@ids": torch.from_numpy(ids[:1])})
    assert {t: v.tolist() for t, v in got.items()} == {"emb": ids.tolist(), "bag": ids[:1].tolist()}
    with pytest.raises(BadRequest, match="carries only '<table>@ids'"):
        e.prefetch_ids({"emb@ids": torch.from_numpy(ids), "emb@rows": torch.zeros(3, DIM)})
    with pytest.raises(BadRequest, match="do not belong"):
        e.prefetch_ids({"emb@ids": torch.from_numpy(ids_of(1, 1))})


def test_live_and_check_live_follow_the_roster():
    e = engine(trainers=3)
    for t in range(3):
        e.hello(t)
    e.close(0)
    e.roster.last_seen[1] -= 60
    assert e.drop_silent(timeout=30) == [1]
    assert e.live() == {2}
    e.check_live(2)
    with pytest.raises(NotAllowed, match="trainer 0 has closed"):
        e.check_live(0)
    with pytest.raises(MustResync, match="trainer 1 was dropped"):
        e.check_live(1)
    e.hello(1)
    assert e.live() == {1, 2}


def test_roster_changes_are_told_after_the_lock_is_released():
    """The Reduce service's lock order needs it: it asks live() (the engine's lock) holding its own."""
    calls = []
    holder = {}

    def on_roster_change():
        # Another thread can take the engine's lock only if this one does not hold it.
        got = []

        def probe():
            cv = holder["e"].cv
            got.append(cv.acquire(timeout=1))
            if got[0]:
                cv.release()

        prober = threading.Thread(target=probe)
        prober.start()
        prober.join()
        calls.append(got[0])

    e = holder["e"] = engine(trainers=3, on_roster_change=on_roster_change)
    for t in range(3):
        e.hello(t)
    assert calls == []  # joining changes nobody's expectation
    e.close(0)
    e.close(0)  # closed already: no change
    assert calls == [True]
    e.roster.last_seen[1] -= 60
    e.drop_silent(timeout=30)
    e.drop_silent(timeout=30)  # nobody else silent: no change
    assert calls == [True, True]
    e.hello(1)  # rejoined: expected again
    assert calls == [True, True, True]


def test_a_roll_back_tells_the_roster_changed(tmp_path):
    """The checkpoint's roster replaces the live one: a trainer dropped since is expected again."""
    seen = []
    e = engine(
        trainers=2, checkpoint_dir=tmp_path, pservers=1, on_roster_change=lambda: seen.append(e.live())
    )
    for t in (0, 1):
        e.hello(t)
    grads = {n: torch.zeros_like(b) for n, b in e.store.blocks.items()}
    for t in (0, 1):
        e.push(t, 0, grads)
    assert e.checkpoint()[0] == 1
    e.roster.last_seen[1] -= 60
    assert e.drop_silent(timeout=30) == [1]
    assert seen == [{0}]
    assert e.restore(0, 1, "roll-back-1") is True
    assert seen == [{0}, {0, 1}]
    assert e.restore(0, 1, "roll-back-1") is False  # honoured once: nothing changes
    assert seen == [{0}, {0, 1}]


def test_on_wait_is_given_at_construction_and_told_how_long_a_sync_call_waited():
    waits = []
    e = engine(trainers=2, on_wait=waits.append)
    for t in (0, 1):
        e.hello(t)
    grads = {n: torch.zeros_like(b) for n, b in e.store.blocks.items()}
    e.push(0, 0, grads)
    e.wait_for_step(0, 0)  # nothing to wait for: not observed
    assert waits == []
    waiter = threading.Thread(target=e.wait_for_step, args=(0, 1))
    waiter.start()
    while not e.cv._waiters:  # the waiter is in the barrier
        time.sleep(0.001)
    e.push(1, 0, grads)
    waiter.join(5)
    assert e.step == 1 and len(waits) == 1 and 0.0 < waits[0] < e.barrier_timeout


@pytest.mark.parametrize("sync", [True, False])
def test_the_engines_leave_reduce_to_its_own_service(sync):
    e = engine(sync=sync)
    assert not hasattr(e, "reduce") and not hasattr(e, "reductions")
