"""Bad sparse pushes and prefetches are refused with a clear status and change nothing."""

import math

import grpc
import numpy as np
import pytest
import torch

from harness.cluster import LocalCluster
from psproto import ps_pb2, ps_pb2_grpc
from psproto.codec import TensorReader, encode_chunks
from tests.helpers.table_models import BAG_DIM, DIM, table_program
from tests.helpers.wire import answer, expect_refusal, open_sessions, push_messages
from transpiler.tables import initial_rows, shard_of


@pytest.fixture
def cluster():
    with LocalCluster(lambda: table_program("adagrad", lr=0.1), 2, 2) as c:
        yield c


@pytest.fixture
def stub(cluster):
    with grpc.insecure_channel(cluster.endpoints[0]) as channel:
        yield ps_pb2_grpc.ParameterServerStub(channel)


def ids_of_shard(shard, n=5, seed=0):
    candidates = np.random.default_rng(seed).integers(-(2**63), 2**63 - 1, size=200, dtype=np.int64)
    return candidates[shard_of(candidates, 2) == shard][:n]


def prefetch_messages(digest, tensors, trainer_id=0, min_step=0, session=""):
    h = ps_pb2.PrefetchHeader(trainer_id=trainer_id, min_step=min_step, layout_digest=digest, session=session)
    return iter([ps_pb2.PrefetchChunk.FromString(b) for b in encode_chunks(h, tensors, 1 << 16)])


@pytest.mark.timeout(30)
def test_bad_sparse_pushes_are_refused_and_change_nothing(cluster, stub):
    server = cluster.servers[0]
    digest = server.program.layout_digest
    sessions = open_sessions(stub, digest)
    mine, theirs = torch.from_numpy(ids_of_shard(0)), torch.from_numpy(ids_of_shard(1))
    rows = torch.full((len(mine), DIM), 0.25)
    nan_rows = rows.clone()
    nan_rows[2, 1] = math.nan
    cases = [
        ([("emb@ids", mine), ("emb@rows", rows[:3])], "5 ids but 3 gradient rows"),
        ([("emb@ids", mine), ("emb@rows", torch.zeros(len(mine), DIM + 1))], "expected [n, 6]"),
        ([("nope@ids", mine), ("nope@rows", rows)], "unknown tensor 'nope@ids'"),
        ([("emb@ids", mine)], "needs both 'emb@ids' and 'emb@rows'"),
        ([("emb@ids", theirs), ("emb@rows", rows)], "shard"),
        ([("emb@ids", mine.float()), ("emb@rows", rows)], "dtype 'float32', expected 'int64'"),
        ([("emb@ids", mine), ("emb@rows", rows.double())], "dtype 'float64', expected 'float32'"),
        ([("emb@ids", mine), ("emb@rows", nan_rows)], "NaN or Inf"),
        ([("emb@next", theirs)], "shard"),
        ([("emb@next", mine.float())], "dtype 'float32', expected 'int64'"),
    ]
    for tensors, match in cases:
        messages = push_messages(digest, tensors=tensors, sessions=sessions)
        details = expect_refusal(
            lambda: answer(stub.PushPull(messages, timeout=10)), grpc.StatusCode.INVALID_ARGUMENT, match
        )
        assert server.endpoint in details
    tables = server.engine.tables
    assert (
        server.engine.step == 0
        and not server.engine.pending.trainers
        and not server.engine.pending.sparse_sums
    )
    assert tables.rows == 0 and all(s.step == 0 for s in tables.shards.values())
    # The pserver still serves: a valid step from both trainers is applied.
    tensors = [("emb@ids", mine), ("emb@rows", rows)]
    calls = [
        stub.PushPull(push_messages(digest, trainer_id, 0, tensors, sessions=sessions), timeout=10)
        for trainer_id in (0, 1)
    ]
    for call in calls:
        reply = answer(call)
        assert reply.counted
    assert server.engine.step == 1 and tables.rows == len(mine)
    assert tables.shards["emb"].step == 1 and tables.shards["bag"].step == 0


@pytest.mark.timeout(30)
def test_bad_prefetches_are_refused(cluster, stub):
    digest = cluster.servers[0].program.layout_digest
    session = open_sessions(stub, digest, [0])[0]
    mine, theirs = torch.from_numpy(ids_of_shard(0)), torch.from_numpy(ids_of_shard(1))

    def prefetch(tensors, **kw):
        return list(
            stub.Prefetch(prefetch_messages(digest, tensors, **{"session": session, **kw}), timeout=10)
        )

    cases = [
        (
            lambda: prefetch([("nope@ids", mine)]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "unknown tensor 'nope@ids'",
        ),
        (
            lambda: prefetch([("emb@rows", torch.zeros(2, DIM))]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "only '<table>@ids'",
        ),
        (lambda: prefetch([("emb@next", mine)]), grpc.StatusCode.INVALID_ARGUMENT, "only '<table>@ids'"),
        (lambda: prefetch([("emb@ids", theirs)]), grpc.StatusCode.INVALID_ARGUMENT, "shard"),
        (
            lambda: prefetch([("emb@ids", mine)], trainer_id=7),
            grpc.StatusCode.INVALID_ARGUMENT,
            "out of range",
        ),
        (
            lambda: prefetch([("emb@ids", mine)], min_step=5),
            grpc.StatusCode.FAILED_PRECONDITION,
            "can only reach 1 next",
        ),
        (
            lambda: list(
                stub.Prefetch(prefetch_messages("bad", [("emb@ids", mine)], session=session), timeout=10)
            ),
            grpc.StatusCode.FAILED_PRECONDITION,
            "plan mismatch",
        ),
        (
            lambda: prefetch([("emb@ids", mine)], session=""),
            grpc.StatusCode.FAILED_PRECONDITION,
            "a call for trainer 0 without a session",
        ),
    ]
    for call, code, match in cases:
        expect_refusal(call, code, match)
    # A good prefetch answers with the initial rows, and does not create them. A row never pushed
    # is a pure function of (table seed, id): the plan's initial_rows, whichever pserver answers.
    emb_ids, bag_ids = torch.cat([mine, mine[:2]]), mine.flip(0)  # repeats allowed, request order kept
    chunks = prefetch([("emb@ids", emb_ids), ("bag@ids", bag_ids)])
    assert cluster.servers[0].engine.tables.rows == 0
    specs = {t.name: t for t in table_program("adagrad", lr=0.1).tables}
    expected = {"emb@rows": ("float32", [-1, DIM]), "bag@rows": ("float32", [-1, BAG_DIM])}
    reader = TensorReader(expected.get)
    for piece in (p for chunk in chunks for p in chunk.pieces):
        reader.add(piece)
    rows = reader.finish()
    assert chunks[0].HasField("header") and chunks[0].header.step == 0
    assert not any(chunk.HasField("header") for chunk in chunks[1:])
    assert list(rows) == ["emb@rows", "bag@rows"]
    for name, ids in (("emb", emb_ids), ("bag", bag_ids)):
        want = initial_rows(specs[name], ids.numpy())
        assert want.shape == (len(ids), specs[name].dim) and np.abs(want).sum() > 0
        np.testing.assert_array_equal(rows[f"{name}@rows"].numpy(), want)
    np.testing.assert_array_equal(rows["emb@rows"][-2:].numpy(), rows["emb@rows"][:2].numpy())


@pytest.mark.timeout(30)
def test_lookup_errors_name_the_table(cluster):
    with cluster.trainer(0) as tr:
        with pytest.raises(KeyError, match="'head' is not a distributed table"):
            tr.pull_rows("head", torch.tensor([1]))
        with pytest.raises(TypeError, match="integer"):
            tr.model.emb(torch.tensor([[0.5, 1.0, 2.0]]))
        with pytest.raises(TypeError, match="takes no offsets"):
            tr.model.emb(torch.tensor([1, 2]), offsets=torch.tensor([0]))
