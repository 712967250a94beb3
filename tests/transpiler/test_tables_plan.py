"""Distributed tables in plans: validation, round trips, and initial rows independent of layout."""

import json

import numpy as np
import pytest
import torch
from torch import nn

from harness.cluster import LocalCluster
from tests.helpers.table_models import table_program
from transpiler import DistributeTranspiler, Program, PserverProgram, TableOptions, TrainerProgram
from transpiler.layout.routing import owner_of
from transpiler.placement import stable_hash_ids
from transpiler.tables import as_ids, initial_rows, merge_duplicates, shard_of


def spec_of(prog, name="emb"):
    return {t.name: t for t in prog.tables}[name]


def test_initial_rows_are_a_pure_function_of_seed_and_id():
    spec = spec_of(table_program("sgd"))
    ids = np.random.default_rng(0).integers(-(2**63), 2**63 - 1, size=1000, dtype=np.int64)
    rows = initial_rows(spec, ids)
    assert rows.shape == (1000, spec.dim) and rows.dtype == np.float32
    perm = np.random.default_rng(1).permutation(1000)
    np.testing.assert_array_equal(initial_rows(spec, ids[perm]), rows[perm])  # order-free
    np.testing.assert_array_equal(
        np.concatenate([initial_rows(spec, part) for part in np.array_split(ids, 7)]), rows
    )  # batch-free
    # torch's nn.Embedding init, N(0, 1), in distribution.
    big = initial_rows(spec, np.arange(200_000))
    assert abs(big.mean()) < 0.01 and abs(big.std() - 1.0) < 0.01
    # Another seed (another table) gives other rows.
    other = spec_of(table_program("sgd", tables={"emb": {"seed": 7}, "bag": None}))
    assert not np.allclose(initial_rows(other, ids[:10]), rows[:10])


def test_initial_rows_follow_init_options():
    prog = table_program(
        "sgd",
        tables={
            "emb": TableOptions(init="uniform", init_kwargs={"a": -0.1, "b": 0.3}),
            "bag": {"init": "zeros"},
        },
    )
    rows = initial_rows(spec_of(prog), np.arange(50_000))
    assert rows.min() >= -0.1 and rows.max() < 0.3 and abs(rows.mean() - 0.1) < 0.005
    assert not initial_rows(spec_of(prog, "bag"), np.arange(100)).any()
    padded = Program(
        nn.Sequential(nn.Embedding(10, 3, padding_idx=2), nn.Linear(3, 1)), distributed_tables=["0"]
    )
    rows = initial_rows(padded.tables[0], np.array([1, 2, 3]))
    assert not rows[1].any() and rows[0].any() and rows[2].any()


@pytest.mark.timeout(60)
def test_pulled_initial_rows_do_not_depend_on_pserver_count_or_order():
    ids = torch.from_numpy(np.random.default_rng(3).integers(-(10**15), 10**15, size=300, dtype=np.int64))
    expected = torch.from_numpy(initial_rows(spec_of(table_program("sgd")), ids.numpy()))
    for n_pservers in (1, 3):
        with LocalCluster(lambda: table_program("sgd", lr=0.1), n_pservers, 1) as cluster:
            with cluster.trainer(0) as tr:
                forward = tr.pull_rows("emb", ids)
                backward = tr.pull_rows("emb", ids.flip(0))
                shaped = tr.pull_rows("emb", ids.view(20, 15))
        torch.testing.assert_close(forward, expected, rtol=0, atol=0)
        torch.testing.assert_close(backward, expected.flip(0), rtol=0, atol=0)
        assert shaped.shape == (20, 15, 6)
        torch.testing.assert_close(shaped.view(300, 6), expected, rtol=0, atol=0)


def test_shard_of_spreads_ids_and_is_stable():
    ids = np.arange(100_000, dtype=np.int64)
    shards = shard_of(ids, 3)
    counts = np.bincount(shards, minlength=3)
    assert counts.min() > 32_000  # balanced even for consecutive ids
    # Known answers, pinned: which pserver owns an id is written into every saved checkpoint's
    # table layout (and seeds the rows), so a change of these values breaks every saved job.
    # The hash of 0 is splitmix64's well-known first output for seed 0 (0xE220A8397B1DCDAF).
    pinned = np.array(
        [0, 1, -1, 2, 7, 123456789, -987654321, 2**31, 2**32 + 5, 10**15, 2**62 + 3, 2**63 - 1, -(2**63)],
        dtype=np.int64,
    )
    assert int(stable_hash_ids(pinned)[0]) == 0xE220A8397B1DCDAF
    assert stable_hash_ids(pinned).tolist() == [
        16294208416658607535,
        10451216379200822465,
        16490336266968443936,
        10905525725756348110,
        7191089600892374487,
        2466975172287755897,
        10239014496013463773,
        2686745474645717868,
        5850300198034702058,
        17921233067608059739,
        9219967605485066917,
        3055647633038352039,
        5196802822362493915,
    ]
    # Version 1 (stable_hash % n), which placed the ids of files saved before version 2: still read.
    expected_v1 = {
        1: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        2: [1, 1, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1],
        3: [1, 2, 2, 1, 0, 2, 1, 0, 2, 1, 1, 0, 1],
        5: [0, 0, 1, 0, 2, 2, 3, 3, 3, 4, 2, 4, 0],
        8: [7, 1, 0, 6, 7, 1, 5, 4, 2, 3, 5, 7, 3],
        64: [47, 1, 32, 14, 23, 57, 29, 44, 42, 27, 37, 39, 27],
    }
    for n_shards, want in expected_v1.items():
        assert owner_of(pinned, n_shards, version=1).tolist() == want, n_shards
    # Version 2 (slots owned by jump_hash), today's.
    expected = {
        1: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        2: [1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 1, 1, 0],
        3: [1, 2, 0, 0, 2, 0, 2, 0, 1, 2, 1, 1, 0],
        5: [3, 4, 0, 0, 4, 3, 2, 0, 3, 2, 1, 1, 4],
        8: [3, 6, 7, 0, 4, 3, 7, 0, 3, 2, 5, 5, 4],
        64: [3, 50, 41, 17, 21, 3, 22, 23, 25, 2, 62, 59, 45],
    }
    for n_shards, want in expected.items():
        got = shard_of(pinned, n_shards)
        assert got.dtype == np.int64 and got.tolist() == want, n_shards
        # Per id or in a batch, in any order: the same owner.
        assert [int(shard_of(pinned[i : i + 1], n_shards)[0]) for i in range(len(pinned))] == want
        assert shard_of(pinned[::-1], n_shards).tolist() == want[::-1]


def test_merge_duplicates_sums_rows_of_equal_ids():
    ids = np.array([5, -1, 5, 7, -1, 5])
    rows = torch.arange(12, dtype=torch.float32).view(6, 2)
    unique, summed = merge_duplicates(ids, rows)
    assert unique.tolist() == [-1, 5, 7]
    assert summed.tolist() == [[2 + 8, 3 + 9], [0 + 4 + 10, 1 + 5 + 11], [6, 7]]
    same_ids, same_rows = merge_duplicates(np.array([3, 1]), rows[:2])
    assert same_rows is rows[:2] or torch.equal(same_rows, rows[:2])


@pytest.mark.parametrize(
    "tables,kwargs,match",
    [
        (["head"], {}, "is not an nn.Embedding or nn.EmbeddingBag"),
        (["nope"], {}, "'nope' is not a module of the model"),
        ({"emb": {"optimizer": "momentum"}}, {}, "unknown table optimizer 'momentum'"),
        (
            {"emb": {"optimizer": "sgd", "optimizer_kwargs": {"momentum": 0.9}}},
            {},
            "does not take ['momentum']",
        ),
        (
            {"emb": {"optimizer": "adam", "optimizer_kwargs": {"weight_decay": 0.1}}},
            {},
            "does not take ['weight_decay']",
        ),
        ({"emb": {"init": "xavier"}}, {}, "init 'xavier' is not one of"),
        ({"emb": {"init": "normal", "init_kwargs": {"a": 1}}}, {}, "does not take ['a']"),
        ({"emb": {"colour": "red"}}, {}, "unknown table options ['colour']"),
        ({"emb": {"seed": -1}}, {}, "seed must be an int"),
        ({"emb": {"init_version": 3}}, {}, "init_version 3 is not one of (1, 2)"),
        (["emb"], {"optimizer": "rmsprop"}, "has no sparse form"),
    ],
)
def test_bad_table_declarations_are_refused(tables, kwargs, match):
    kwargs = {"optimizer": "sgd", **kwargs}
    model = table_program("sgd").model
    with pytest.raises(ValueError) as info:
        Program(model, kwargs.pop("optimizer"), distributed_tables=tables, **kwargs)
    assert match in str(info.value)


@pytest.mark.parametrize(
    "module,match",
    [
        (nn.Embedding(10, 3, max_norm=1.0), "max_norm"),
        (nn.Embedding(10, 3, scale_grad_by_freq=True), "scale_grad_by_freq"),
        (nn.Embedding(10, 3, dtype=torch.float16), "dtype float16"),
    ],
)
def test_embedding_features_a_table_cannot_honour_are_refused(module, match):
    with pytest.raises(ValueError, match=match):
        Program(nn.Sequential(module, nn.Linear(3, 1)), distributed_tables=["0"])


def test_init_version_is_2_unless_given_and_1_in_plans_without_it():
    prog = table_program("sgd", tables={"emb": {"init_version": 1}, "bag": None})
    assert spec_of(prog).init_version == 1 and spec_of(prog, "bag").init_version == 2
    t = DistributeTranspiler()
    t.transpile(0, program=prog, pservers="127.0.0.1:7001", trainers=1)
    ps = t.get_pserver_program("127.0.0.1:7001")
    assert [x.init_version for x in PserverProgram.from_bytes(ps.to_bytes()).tables] == [1, 2]
    written_before = json.loads(ps.to_bytes())  # a plan written before versions: no field
    for table in written_before["tables"]:
        del table["init_version"]
    old = PserverProgram.from_bytes(json.dumps(written_before).encode())
    assert [x.init_version for x in old.tables] == [1, 1]


def test_derived_table_optimizers_carry_only_sparse_kwargs():
    prog = table_program("adam", lr=0.01, betas=(0.8, 0.9), weight_decay=0.1, amsgrad=False)
    assert spec_of(prog).optimizer.name == "adam"
    assert spec_of(prog).optimizer.kwargs == {"lr": 0.01, "betas": (0.8, 0.9)}
    prog = table_program("momentum", lr=0.2, lr_scheduler="StepLR", lr_scheduler_kwargs={"step_size": 3})
    assert spec_of(prog).optimizer.name == "sgd" and spec_of(prog).optimizer.kwargs == {"lr": 0.2}
    assert spec_of(prog).optimizer.lr_scheduler == "StepLR"


def test_plans_with_tables_round_trip_and_print():
    t = DistributeTranspiler()
    t.transpile(
        1, program=table_program("adagrad", lr=0.1), pservers="127.0.0.1:7001,127.0.0.1:7002", trainers=2
    )
    ps = t.get_pserver_program("127.0.0.1:7002")
    assert ps.shard == 1 and [x.name for x in ps.tables] == ["emb", "bag"]
    assert PserverProgram.from_bytes(ps.to_bytes()) == ps
    tp = t.get_trainer_program()
    assert TrainerProgram.from_bytes(tp.to_bytes()) == tp
    text = str(ps)
    assert "distributed tables, sharded by id over 2 pservers" in text and "bag (mean)" in text
    assert "adagrad" in str(tp)
    # Table options are part of the layout both sides must agree on.
    other = DistributeTranspiler()
    other.transpile(
        1,
        program=table_program("adagrad", tables={"emb": {"seed": 1}, "bag": None}, lr=0.1),
        pservers="127.0.0.1:7001,127.0.0.1:7002",
        trainers=2,
    )
    assert other.get_trainer_program().layout_digest != tp.layout_digest


class MetaTables(nn.Module):
    """Tables declared on the meta device with a capacity hint no machine could allocate."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10**12, 8, sparse=True, device="meta")
        self.bag = nn.EmbeddingBag(10**12, 4, mode="sum", device="meta")
        self.head = nn.Linear(12, 1)

    def forward(self, ids):
        return self.head(torch.cat([self.emb(ids).sum(1), self.bag(ids)], 1))


@pytest.mark.timeout(60)
def test_tables_built_on_the_meta_device_train():
    def build():
        torch.manual_seed(0)
        return Program(MetaTables(), "sgd", lr=0.5, distributed_tables=["emb", "bag"])

    ids = torch.tensor([[1, 2**50, -7], [3, 3, 1]])
    with LocalCluster(build, 2, 1) as cluster:
        with cluster.trainer(0) as tr:
            before = tr.pull_rows("emb", ids)
            tr.model(ids).sum().backward()
            tr.step()
            after = tr.pull_rows("emb", ids)
            # d(sum of outputs)/d(row) = head.weight[:8] per use; id 3 used twice, id 1 twice.
            w = build().model.head.weight.detach()[0, :8]
            uses = {1: 2, 2**50: 1, -7: 1, 3: 2}
            for pos, i in enumerate(ids.flatten().tolist()):
                torch.testing.assert_close(
                    after.view(-1, 8)[pos], before.view(-1, 8)[pos] - 0.5 * uses[i] * w
                )
        assert sum(s.engine.tables.rows for s in cluster.servers) == 2 * 4  # 4 ids, 2 tables


@pytest.mark.parametrize(
    "ids, expected",
    [
        (torch.tensor([[3, -1], [2**62, 0]]), [3, -1, 2**62, 0]),  # any shape, flattened
        (torch.tensor([1, 2], dtype=torch.int32), [1, 2]),
        (torch.tensor([7], dtype=torch.uint8), [7]),
        (np.array([5, 6], dtype=np.uint16), [5, 6]),
        ([4, -4], [4, -4]),
        ([], []),  # an empty list reads as float64
    ],
)
def test_as_ids_reads_integers_of_any_shape_as_flat_int64(ids, expected):
    out = as_ids(ids)
    assert out.dtype == np.int64 and out.flags["C_CONTIGUOUS"] and out.tolist() == expected


@pytest.mark.parametrize("ids", [torch.tensor([0.5]), torch.tensor([True]), np.array([1.0, 2.0]), ["a"]])
def test_as_ids_refuses_non_integers_naming_the_dtype(ids):
    with pytest.raises(TypeError, match="ids must be integers, got"):
        as_ids(ids)
