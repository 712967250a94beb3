"""Push and answer payloads between a trainer (trainer/transport/data/payloads.py) and a pserver
(pserver/data/parts.py): what one writes the other reads, exactly, and a bad payload changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from pserver.data.parts import Payloads
from pserver.engine import Contents
from pserver.errors import BadRequest
from pserver.flat import FlatGrad
from pserver.store import BlockStore
from pserver.tables.table_set import TableSet
from tests.helpers.table_models import BAG_DIM, DIM
from trainer.transport.data.payloads import PserverPayloads
from transpiler import DistributeTranspiler, DistributeTranspilerConfig, Program
from transpiler.tables import shard_of

EPS = ["127.0.0.1:1", "127.0.0.1:2"]


class Wide(nn.Module):
    """Two tables and a head wide enough to be sliced into several blocks per pserver."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(100, DIM, sparse=True)
        self.bag = nn.EmbeddingBag(100, BAG_DIM, sparse=True)
        self.head = nn.Sequential(nn.Linear(22, 1500), nn.ReLU(), nn.Linear(1500, 3))


@pytest.fixture(scope="module")
def sides():
    t = DistributeTranspiler(DistributeTranspilerConfig(slice_var_up=True))
    program = Program(Wide(), "sgd", lr=0.5, distributed_tables=["emb", "bag"])
    t.transpile(0, program=program, pservers=",".join(EPS), trainers=2, sync_mode=True)
    ps = t.get_pserver_program(EPS[0])
    contents = Contents(BlockStore(ps, t.get_startup_program(EPS[0], ps)), TableSet(ps))
    trainer = t.get_trainer_program()
    mine = [b for b in trainer.blocks if b.endpoint == EPS[0]]
    return (
        PserverPayloads(mine, trainer.tables),
        Payloads(contents, allow_nonfinite=False),
        mine,
        trainer.tables,
    )


def ids_on_shard0(n, seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(-(2**40), 2**40, size=8 * n, dtype=np.int64)
    return np.unique(ids[shard_of(ids, 2) == 0])[:n]


def push_tensors(blocks, tables, seed=0, absent=(), dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    out = [(b.name, torch.randn(b.shape, generator=g).to(dtype)) for b in blocks if b.name not in absent]
    for i, t in enumerate(tables):
        ids = ids_on_shard0(5 + i, seed + i)
        out += [
            (t.ids_name, torch.from_numpy(ids)),
            (t.rows_name, torch.randn(len(ids), t.dim, generator=g)),
            (t.next_name, torch.from_numpy(ids_on_shard0(7, seed + 10 + i))),
        ]
    return out


@pytest.mark.parametrize("lanes", [1, 2])
def test_what_a_trainer_pushes_the_pserver_reads(sides, lanes):
    trainer, pserver, blocks, tables = sides
    assert len(blocks) >= 3  # lanes get different blocks, one of them absent
    tensors = push_tensors(blocks, tables, absent={blocks[1].name})
    for lane in range(lanes):
        names = set(trainer.lane(lanes, lane).names)
        mine = [(n, t) for n, t in tensors if n in names or (lane == 0 and "@" in n)]
        push = trainer.plan_push(mine, lanes, lane, dropped=False)
        out = np.zeros(push.layout.nbytes, dtype=np.uint8)
        trainer.write_push(out, push, lanes, lane)
        parts, _ = pserver.push(out, lanes, lane, push.grad_dtype, dropped=False)
        expected_dense = {n: t for n, t in mine if "@" not in n}
        assert parts.dense.keys() == expected_dense.keys()
        assert all(torch.equal(parts.dense[n], t) for n, t in expected_dense.items())
        if lane:
            assert parts.sparse == {} and parts.answer_ids == {}
            continue
        for t in tables:
            sent = dict(mine)
            ids, rows = parts.sparse[t.name]
            assert np.array_equal(ids, sent[t.ids_name].numpy()) and torch.equal(rows, sent[t.rows_name])
            assert np.array_equal(parts.answer_ids[t.name], sent[t.next_name].numpy())


def test_gradients_narrowed_to_bfloat16_are_widened_exactly(sides):
    trainer, pserver, blocks, tables = sides
    tensors = [(n, t) for n, t in push_tensors(blocks, tables, dtype=torch.bfloat16) if "@" not in n]
    push = trainer.plan_push(tensors, 1, 0, dropped=False)
    out = np.zeros(push.layout.nbytes, dtype=np.uint8)
    trainer.write_push(out, push, 1, 0)
    parts, _ = pserver.push(out, 1, 0, push.grad_dtype, dropped=False)
    assert all(torch.equal(parts.dense[n], t.float()) for n, t in tensors)


def test_an_answer_the_pserver_writes_lands_where_the_trainer_says(sides):
    trainer, pserver, blocks, tables = sides
    lane = pserver.lane(1, 0)
    values = [(b.name, torch.randn(b.shape)) for b in blocks]
    rows = [
        (t.rows_name, np.random.default_rng(i).standard_normal((4 + i, t.dim)).astype(np.float32))
        for i, t in enumerate(tables)
    ]
    answer = np.zeros(
        pserver.answer_bytes(lane, {t.name: np.zeros(4 + i) for i, t in enumerate(tables)}), np.uint8
    )
    n = pserver.write(answer, lane, values, rows)
    inline = np.concatenate(
        [np.frombuffer(memoryview(b).cast("B"), np.uint8) for b in pserver.buffers(lane, values, rows)]
    )
    assert n == answer.size and np.array_equal(inline, answer)
    got = {}

    def into(name):
        shape = next((b.shape for b in blocks if b.name == name), None)
        if shape is None:
            t = next(t for t in tables if t.rows_name == name)
            shape = [dict(rows)[name].shape[0], t.dim]
        got[name] = torch.empty(shape)
        return got[name]

    trainer.read_answer(answer, trainer.lane(1, 0), [4 + i for i in range(len(tables))], into)
    assert all(torch.equal(got[n], v) for n, v in values)
    assert all(np.array_equal(got[n].numpy(), r) for n, r in rows)


@pytest.mark.parametrize(
    "corrupt, match",
    [
        (lambda p: p[:-64], "a push payload of"),
        (lambda p: np.concatenate([p, np.zeros(64, np.uint8)]), "a push payload of"),
        (lambda p: _set(p, 0, 2), "presence bytes"),
        (lambda p: _nan(p), "NaN or Inf"),
    ],
)
def test_a_bad_push_payload_is_refused(sides, corrupt, match):
    trainer, pserver, blocks, tables = sides
    tensors = push_tensors(blocks, tables)
    push = trainer.plan_push(tensors, 1, 0, dropped=False)
    out = np.zeros(push.layout.nbytes, dtype=np.uint8)
    trainer.write_push(out, push, 1, 0)
    with pytest.raises(BadRequest, match=match):
        pserver.push(corrupt(out.copy()), 1, 0, push.grad_dtype, dropped=False)


def test_ids_of_another_shard_are_refused(sides):
    trainer, pserver, blocks, tables = sides
    tensors = push_tensors(blocks, tables)
    rng = np.random.default_rng(3)
    other = rng.integers(0, 2**40, size=200, dtype=np.int64)
    other = other[shard_of(other, 2) == 1][:5]
    tensors = [(n, torch.from_numpy(other) if n == tables[0].next_name else t) for n, t in tensors]
    push = trainer.plan_push(tensors, 1, 0, dropped=False)
    out = np.zeros(push.layout.nbytes, dtype=np.uint8)
    trainer.write_push(out, push, 1, 0)
    with pytest.raises(BadRequest, match="do not belong to shard 0"):
        pserver.push(out, 1, 0, push.grad_dtype, dropped=False)


def _set(p, i, v):
    p[i] = v
    return p


def _nan(p):
    p[64:68] = np.frombuffer(np.float32(np.nan).tobytes(), np.uint8)
    return p


def test_a_table_gradient_with_no_id_on_this_shard_still_counts_a_step(sides):
    """torch's optimizers count a step for every parameter with a gradient: an empty one travels too."""
    trainer, pserver, blocks, tables = sides
    empty = tables[0]
    tensors = [
        (n, t[:0] if n in (empty.ids_name, empty.rows_name) else t) for n, t in push_tensors(blocks, tables)
    ]
    tensors = [(n, t) for n, t in tensors if n != tables[1].ids_name and n != tables[1].rows_name]
    push = trainer.plan_push(tensors, 1, 0, dropped=False)
    out = np.zeros(push.layout.nbytes, dtype=np.uint8)
    trainer.write_push(out, push, 1, 0)
    parts, _ = pserver.push(out, 1, 0, push.grad_dtype, dropped=False)
    assert list(parts.sparse) == [empty.name]  # the second table pushed no gradient at all
    assert len(parts.sparse[empty.name][0]) == 0


def test_a_one_lane_push_is_the_stores_flat_gradient_and_its_padding_and_absent_blocks_are_not_read(sides):
    """One lane: the dense section is the store's flat gradient as it came (a view, no call per block). NaN
    in the padding between blocks or in an absent block is neither refused nor kept: the padding is
    zeroed (the flat optimizer needs zeros there) and an absent block is never read."""
    trainer, pserver, blocks, tables = sides
    absent = blocks[1].name
    tensors = [(n, t) for n, t in push_tensors(blocks, tables, absent={absent}) if "@" not in n]
    push = trainer.plan_push(tensors, 1, 0, dropped=False)
    out = np.zeros(push.layout.nbytes, dtype=np.uint8)
    trainer.write_push(out, push, 1, 0)
    store_layout = pserver.contents.store.flat_layout
    dense_at = push.layout.dense[0]
    values = out[dense_at : dense_at + push.layout.dense[1]].view(np.float32)
    first_end = store_layout.starts[0] + store_layout.dense.numels[0]
    assert first_end < store_layout.starts[1]  # the first block is followed by padding
    values[first_end] = np.nan
    j = store_layout.index[absent]
    values[store_layout.starts[j]] = np.inf
    parts, nbytes = pserver.push(out, 1, 0, push.grad_dtype, dropped=False)
    assert isinstance(parts.dense, FlatGrad) and parts.dense.layout is store_layout
    assert parts.dense.flat.data_ptr() == values.ctypes.data  # a view of the payload
    assert values[first_end] == 0
    assert absent not in parts.dense and list(parts.dense) == [n for n, _ in tensors]
    assert all(torch.equal(parts.dense[n], t) for n, t in tensors)
    assert nbytes == sum(t.numel() * 4 for _, t in tensors)
