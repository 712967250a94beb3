"""A plain table's compiled apply and lookup give the numpy path's rows, state and counts, bit for bit.

The reference is the same shard with its compiled path switched off (``compiled = None``): the numpy
rules of :mod:`pserver.tables.sparse_optim`, the functional definitions, which
tests/tables/test_shard.py compares with torch. Random steps mix new and stored ids, repeat steps,
push nothing, look up ids never stored (with repeats), grow the arrays, in float32 and float64, for
sgd, adagrad and adam, every initial-row kind of both versions, with a ``padding_idx``.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

from pserver.tables import id_index
from pserver.tables.compiled import init_kernels, row_kernels
from pserver.tables.shard import TableShard
from pserver.tables.sparse_optim import adagrad, make_rule, sgd, sparse_adam
from tests.helpers.table_specs import grads_for, make_spec
from transpiler.lifecycle import TableLifecycle
from transpiler.tables import initial_rows

pytestmark = pytest.mark.skipif(id_index.load_kernels() is None, reason="numba is not installed")

OPTIMIZERS = {
    "sgd": {},
    "adagrad": {"lr_decay": 0.05, "initial_accumulator_value": 0.3, "eps": 1e-6},
    "adam": {"betas": (0.8, 0.95), "eps": 1e-6},
}
INITS = [("normal", 1), ("normal", 2), ("uniform", 2), ("zeros", 2)]


def spec_for(optimizer, dtype, init, version, dim=5):
    spec = make_spec(
        dim=dim, optimizer=optimizer, kwargs=OPTIMIZERS[optimizer], dtype=dtype, init=init, capacity=8
    )
    return dataclasses.replace(spec, init_version=version, padding_idx=7)


def pair(spec):
    """(compiled shard, numpy shard) of ``spec``."""
    compiled, reference = TableShard(spec, 0, 1), TableShard(spec, 0, 1)
    assert compiled.compiled is not None
    reference.compiled = None
    return compiled, reference


def state(t: TableShard) -> list:
    m = t.memory
    return [a.tobytes() for a in (m.ids, m.rows, *m.state, m.meta["seen_step"])] + [t.step, len(t)]


@pytest.mark.parametrize("init,version", INITS, ids=[f"{i} v{v}" for i, v in INITS])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_compiled_path_equals_the_numpy_path(optimizer, dtype, init, version):
    spec = spec_for(optimizer, dtype, init, version)
    compiled, reference = pair(spec)
    rng = np.random.default_rng(len(optimizer) * 7 + version)
    for step in range(12):
        n = 0 if step in (3, 7) else int(rng.integers(1, 300))  # some steps push nothing
        ids = rng.permutation(np.unique(rng.integers(-400, 400, size=n)))
        asked = np.concatenate([ids, rng.integers(-600, 600, size=40), [7, 7]])  # unknown ids, repeats
        for t in (compiled, reference):
            assert t.lookup(asked).tobytes() == reference.lookup(asked).tobytes()
        grads = grads_for(ids, spec.dim, step, np.dtype(dtype))
        lr = 0.1 * 0.9**step
        compiled.apply(ids, grads, lr)
        reference.apply(ids, grads, lr)
        assert state(compiled) == state(reference), f"step {step}"
    every = np.arange(-700, 700)
    assert compiled.lookup(every).tobytes() == reference.lookup(every).tobytes()
    assert compiled.life.counts.admitted == reference.life.counts.admitted == len(reference)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_batches_of_several_prefetch_blocks_equal_the_numpy_path(optimizer):
    """Finds, applies and lookups of more ids than one prefetch block (and rows read past its ends)."""
    from pserver.tables.compiled.prefetch import BLOCK

    spec = spec_for(optimizer, "float32", "uniform", 2, dim=16)
    compiled, reference = pair(spec)
    rng = np.random.default_rng(5)
    for step in range(3):
        ids = rng.permutation(np.unique(rng.integers(0, 4 * BLOCK, size=3 * BLOCK)))  # stored and new
        assert ids.size > 2 * BLOCK
        grads = grads_for(ids, spec.dim, step, np.dtype("float32"))
        compiled.apply(ids, grads, 0.05)
        reference.apply(ids, grads, 0.05)
        assert state(compiled) == state(reference), f"step {step}"
        asked = rng.integers(-BLOCK, 5 * BLOCK, size=BLOCK * 5 // 2)  # unknown ids and repeats too
        assert compiled.lookup(asked).tobytes() == reference.lookup(asked).tobytes()


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_kernel_updates_equal_the_functional_rules(optimizer):
    """Rows stored, then one step of the rule on copies of them: what the kernel writes in place."""
    spec = spec_for(optimizer, "float32", "normal", 2, dim=16)
    t = TableShard(spec, 0, 1)
    rng = np.random.default_rng(4)
    ids = rng.integers(-(2**62), 2**62, size=2000)
    for step in range(3):
        t.apply(ids, grads_for(ids, 16, step), 0.05)
    rule = make_rule(optimizer, OPTIMIZERS[optimizer])
    param, states = t.lookup(ids), [s.copy() for s in t.memory.state]
    grad = grads_for(ids, 16, 9)
    if optimizer == "sgd":
        sgd(param, grad, lr=0.05)
    elif optimizer == "adagrad":
        adagrad(param, *states, grad, lr=0.05, step=4, **rule.hyper)
    else:
        sparse_adam(param, *states, grad, lr=0.05, step=4, **rule.hyper)
    t.apply(ids, grad, 0.05)
    assert t.lookup(ids).tobytes() == param.tobytes()
    assert [s.tobytes() for s in t.memory.state] == [s.tobytes() for s in states]


def test_repeated_ids_are_refused_and_change_nothing():
    compiled, reference = pair(spec_for("adam", "float32", "normal", 2))
    ids = np.arange(50, dtype=np.int64)
    for t in (compiled, reference):
        t.apply(ids, grads_for(ids, 5, 0), 0.1)
    before = state(compiled)
    for bad in ([1, 900, 901, 900], [1, 2, 3, 2], [900, 1, 2, 1, 901]):  # a new id twice, a stored one twice
        bad = np.array(bad, dtype=np.int64)
        values, counts = np.unique(bad, return_counts=True)
        with pytest.raises(ValueError, match=f"id {values[counts.argmax()]} appears twice"):
            compiled.apply(bad, grads_for(bad, 5, 1), 0.1)
        assert state(compiled) == before
    np.testing.assert_array_equal(compiled.memory.find(np.array([900, 901]))[0], [-1, -1])
    again = np.array([900, 3, 901], dtype=np.int64)  # the index still works after the roll-backs
    compiled.apply(again, grads_for(again, 5, 2), 0.1)
    reference.apply(again, grads_for(again, 5, 2), 0.1)
    assert state(compiled) == state(reference)


def test_payload_views_are_used_as_they_are():
    """Ids and rows read-only views of received bytes; rows looked up straight into an answer's buffer."""
    spec = spec_for("sgd", "float32", "normal", 2, dim=4)
    compiled, reference = pair(spec)
    ids = np.array([5, -3, 9, 11], dtype=np.int64)
    grads = grads_for(ids, 4, 0)
    payload = bytes(64) + ids.tobytes() + grads.tobytes()
    view_ids = np.frombuffer(payload, np.int64, 4, 64)
    view_rows = np.frombuffer(payload, np.float32, 16, 96).reshape(4, 4)
    assert not view_ids.flags.writeable and not view_rows.flags.writeable
    compiled.apply(view_ids, view_rows, 0.5)
    reference.apply(ids, grads, 0.5)
    assert state(compiled) == state(reference)
    answer = np.zeros(256, np.uint8)
    out = answer[64 : 64 + 6 * 16].view(np.float32).reshape(6, 4)
    asked = np.array([9, 1, 5, 2, 9, 7], dtype=np.int64)
    assert compiled.lookup_into(asked, out) is out
    assert out.tobytes() == reference.lookup(asked).tobytes() and not answer[:64].any()
    strided = np.zeros((6, 8), np.float32)[:, ::2]  # not contiguous: written through a copy
    compiled.lookup_into(asked, strided)
    np.testing.assert_array_equal(strided, out)
    with pytest.raises(ValueError, match="do not fit"):
        compiled.lookup_into(asked, np.zeros((5, 4), np.float32))


def test_only_plain_tables_take_the_compiled_path():
    assert TableShard(make_spec(), 0, 1).compiled is not None
    for lifecycle in (TableLifecycle(admit_count=2), TableLifecycle(evict_unseen_steps=3)):
        assert TableShard(dataclasses.replace(make_spec(), lifecycle=lifecycle), 0, 1).compiled is None


def test_initial_rows_of_a_lookup_and_an_insert_are_the_definition_s():
    """Rows of ids not stored, looked up (computed after the lock) and inserted (computed in the kernel)."""
    spec = make_spec(dim=3, seed=11)
    t = TableShard(spec, 0, 1)
    ids = np.arange(-5000, 5000, dtype=np.int64)
    np.testing.assert_array_equal(t.lookup(ids), initial_rows(spec, ids))
    t.apply(ids, np.zeros((ids.size, 3), np.float32), 0.1)
    np.testing.assert_array_equal(t.memory.rows, initial_rows(spec, ids))


def test_kernels_run_without_the_interpreter_lock_on_two_threads():
    """The kernels are compiled ``nogil``; two threads applying to and looking up two tables at once."""
    assert all(
        k.targetoptions.get("nogil") for k in (row_kernels.apply, row_kernels.lookup, init_kernels.init_rows)
    )
    tables = [TableShard(make_spec(dim=16), 0, 1) for _ in range(2)]
    ids = np.arange(200_000, dtype=np.int64)
    errors = []

    def work(t):
        try:
            for _ in range(3):
                t.apply(ids, np.ones((ids.size, 16), np.float32), 0.1)
                t.lookup(ids)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in tables]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and all(t.step == 3 for t in tables)


def test_the_kernels_prefetch_with_llvm_on_this_numba_and_change_no_value():
    """The lookup and apply above ran with the prefetch compiled in, not its no-op stand-in; asking for a
    line leaves every array as it was (1-D and 2-D, at the first and last element)."""
    import numba

    from pserver.tables.compiled import prefetch

    assert prefetch.prefetch is prefetch._llvm_prefetch

    @numba.njit
    def ask_then_read(a, i):
        prefetch.prefetch(a, i)
        return a[i]

    rows = np.arange(12, dtype=np.float32).reshape(4, 3)
    ids = np.arange(5, dtype=np.int64) * 7
    before = rows.copy(), ids.copy()
    assert ask_then_read(rows, 3).tolist() == [9.0, 10.0, 11.0] and ask_then_read(ids, 0) == 0
    assert ask_then_read(ids, np.int32(4)) == 28  # an index of any integer width (a slot's row number)
    assert np.array_equal(rows, before[0]) and np.array_equal(ids, before[1])
