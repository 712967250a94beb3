"""The pserver the fuzzer runs against, and a valid base request for each method.

:class:`Env` describes a sync pserver of :data:`TRAINERS` trainers holding dense blocks of
:class:`FuzzModel` and a shard of its two distributed tables, and the live job on it: one
Trainer per id, heartbeating, whose sessions (``Env.sessions``) the bases carry so that the
fuzzing reaches every check behind the session check. Every method of the service
gets a valid base request (:func:`base_requests`): one the pserver must refuse, or that cannot
change its state even when valid; fuzz_series turns it into the series of cases. The rare
mutation that turns into a request that may legitimately change the state is told apart by
:func:`legit_change`. :func:`make_env` describes the pserver of a running cluster; :func:`train_one_step`
has the live job train a real step once the fuzzing is over (the gRPC fuzzer's and the data channel's).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import grpc
import numpy as np
import torch
from google.protobuf.message_factory import GetMessageClass
from torch import nn

from harness.cluster import LocalCluster
from psproto import ps_pb2
from psproto.codec import decode_chunk, encode_chunks, encode_into
from psproto.dtypes import DTYPES
from psproto.shared_memory import Region
from transpiler import Program
from transpiler.tables import shard_of

SERVICE = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"]
METHODS = {m.name: m for m in SERVICE.methods}

TRAINERS = 2
FUTURE_STEP = 5  # the step of the base pushes: the pserver is at step 0
STREAM_CHUNK = 4096  # chunk size of streamed push bases: ~10 messages
PREFETCH_CHUNK = 256  # ... of the streamed prefetch base: several messages
ONE_MESSAGE = 1 << 30
WRONG_DIGEST = "0123456789abcdef"


# -- the pserver under fuzz -------------------------------------------------------------

SLOTS, BAG_LEN, DIM, BAG_DIM = 2, 5, 4, 3


class FuzzModel(nn.Module):
    """Two distributed tables and a dense part whose big weight is cut into blocks."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(1000, DIM, sparse=True)
        self.bag = nn.EmbeddingBag(1000, BAG_DIM, mode="mean", sparse=True)
        self.fc = nn.Linear(SLOTS * DIM + BAG_DIM, 1500)  # 16500 weights: a block per pserver
        self.out = nn.Linear(1500, 2)

    def forward(self, ids, bag):
        h = torch.cat([self.emb(ids).flatten(1), self.bag(bag)], dim=1)
        return self.out(torch.relu(self.fc(h)))


def build() -> Program:
    torch.manual_seed(0)
    return Program(FuzzModel(), "sgd", lr=0.1, distributed_tables=["emb", "bag"])


@dataclass
class Case:
    desc: str
    messages: List[bytes]  # the request; exactly one message for a unary request
    refuse: bool = False  # hand-made bad input: an OK answer is a failure


@dataclass
class Env:
    cluster: LocalCluster
    channel: grpc.Channel
    tmp: Path
    digest: str
    blocks: Dict[str, Tuple[str, List[int]]]  # this pserver's blocks: (dtype, shape)
    other_blocks: List[str]  # blocks of the other pserver
    tables: Dict[str, int]  # table -> dim
    own_ids: np.ndarray  # ids of this pserver's shard
    foreign_ids: np.ndarray  # ids of the other shard
    sessions: Dict[int, str]  # the live trainers' sessions on this pserver
    trainers: list  # the live job's Trainer per id
    grads: List[Tuple[str, torch.Tensor]] = field(default_factory=list)
    prefetch_ids: List[Tuple[str, torch.Tensor]] = field(default_factory=list)
    bases: Dict[str, List[bytes]] = field(default_factory=dict)
    crafted: Dict[str, List[Case]] = field(default_factory=dict)
    before: Dict[str, bytes] = field(default_factory=dict)  # block bytes before fuzzing
    # PushPullShared's base: a region holding the base push (its length) and a region for the answer
    shared: Optional[Tuple[Region, int, Region]] = None

    @property
    def server(self):
        return self.cluster.servers[0]

    @property
    def names(self) -> List[str]:
        return [*self.blocks, *(f"{t}@{p}" for t in self.tables for p in ("ids", "rows"))]


def make_env(cluster: LocalCluster, channel: grpc.Channel, tmp: Path, trainers: list, seed: int) -> Env:
    """The :class:`Env` of ``cluster``'s first pserver and the live job ``trainers`` on it (joined): its
    blocks, ids of its shard and of the other one (drawn with ``seed``), the trainers' sessions, a push's
    gradients and the base requests. The hand-made cases and the blocks' bytes before fuzzing are the
    caller's to add."""
    server, other = cluster.servers
    program = server.program
    store = server.engine.store
    candidates = np.random.default_rng(seed).integers(-(2**62), 2**62, size=400, dtype=np.int64)
    owner = shard_of(candidates, len(program.pservers))
    e = Env(
        cluster=cluster,
        channel=channel,
        tmp=tmp,
        digest=program.layout_digest,
        blocks={n: store.expect(n) for n in store.names()},
        other_blocks=sorted(other.engine.store.names()),
        tables={t.name: t.dim for t in program.tables},
        own_ids=candidates[owner == program.shard],
        foreign_ids=candidates[owner != program.shard],
        sessions={t: tr.channels[cluster.endpoints[0]].session for t, tr in enumerate(trainers)},
        trainers=trainers,
    )
    assert WRONG_DIGEST != e.digest and len(e.own_ids) >= 100 and len(e.foreign_ids) >= 20
    e.grads = [(n, torch.full(shape, 0.01, dtype=DTYPES[dtype])) for n, (dtype, shape) in e.blocks.items()]
    e.grads += table_grads(e, "emb", e.own_ids[:20]) + table_grads(e, "bag", e.own_ids[20:35])
    # Repeats allowed in a prefetch: the rows come back in request order.
    e.prefetch_ids = [
        ("emb@ids", torch.from_numpy(np.concatenate([e.own_ids[:60], e.own_ids[:5]]))),
        ("bag@ids", torch.from_numpy(e.own_ids[60:100].copy())),
    ]
    e.bases = base_requests(e)
    return e


def close_env(e: Env) -> None:
    """Close what :func:`make_env` opened beside the cluster (PushPullShared's base regions)."""
    if e.shared is not None:
        e.shared[0].close()
        e.shared[2].close()


def train_one_step(e: Env) -> Dict[int, float]:
    """The live job's trainers train one real sync step, each in its own thread; their losses by id."""
    rng = np.random.default_rng(1)

    def body(tr):
        n = 4
        ids = torch.from_numpy(rng.choice(e.own_ids, size=(n, SLOTS)))
        bag = torch.from_numpy(rng.choice(e.foreign_ids, size=(n, BAG_LEN)))
        y = torch.from_numpy(np.arange(n) % 2)
        loss = nn.functional.cross_entropy(tr.model(ids, bag), y)
        loss.backward()
        tr.step()
        return loss.item()

    losses, errors = {}, []

    def train(t):
        try:
            losses[t] = body(e.trainers[t])
        except BaseException as ex:  # reported on the caller's thread
            errors.append(ex)

    threads = [threading.Thread(target=train, args=(t,)) for t in range(TRAINERS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not any(th.is_alive() for th in threads), "the live job's step did not finish within 60s"
    assert not errors, errors
    return losses


def table_grads(e: Env, table: str, ids: np.ndarray, dtype=torch.float32):
    return [
        (f"{table}@ids", torch.from_numpy(np.ascontiguousarray(ids))),
        (f"{table}@rows", torch.full((len(ids), e.tables[table]), 0.01, dtype=dtype)),
    ]


# -- base requests: valid messages the pserver must refuse, or that cannot change state --


def push_stream(e: Env, chunk: int, tensors=None, **header) -> List[bytes]:
    h = dict(trainer_id=0, step=FUTURE_STEP, layout_digest=e.digest, epoch=1, batch=2, session=e.sessions[0])
    h.update(header)
    return list(encode_chunks(ps_pb2.PushHeader(**h), e.grads if tensors is None else tensors, chunk))


def shared_push(e: Env) -> List[bytes]:
    """A SharedPush naming a region of this process that holds the base push (step 5, from the future)."""
    if e.shared is None:
        request, answer = Region(1 << 20), Region(1 << 20)
        h = dict(
            trainer_id=0, step=FUTURE_STEP, layout_digest=e.digest, epoch=1, batch=2, session=e.sessions[0]
        )
        e.shared = (request, encode_into(request.view, ps_pb2.PushHeader(**h), e.grads), answer)
    request, length, answer = e.shared
    return [
        ps_pb2.SharedPush(
            request=request.address(ps_pb2.SharedRegion),
            request_bytes=length,
            answer=answer.address(ps_pb2.SharedRegion),
        ).SerializeToString()
    ]


def prefetch_stream(e: Env, chunk: int, tensors=None, **header) -> List[bytes]:
    h = dict(trainer_id=0, min_step=0, layout_digest=e.digest, session=e.sessions[0])
    h.update(header)
    return list(
        encode_chunks(ps_pb2.PrefetchHeader(**h), e.prefetch_ids if tensors is None else tensors, chunk)
    )


def base_requests(e: Env) -> Dict[str, List[bytes]]:
    """A valid request per method. ADD ONE HERE for every new method of the service.

    Each carries trainer 0's live session (the fuzzing then reaches the checks behind it);
    the hand-made cases (fuzz_crafted) send the same calls without one, or with a wrong one.
    """
    s = lambda m: [m.SerializeToString()]  # noqa: E731
    own = e.sessions[0]
    return {
        "Hello": s(ps_pb2.HelloRequest(trainer_id=0, layout_digest=WRONG_DIGEST, incarnation=1)),
        "Pull": s(
            ps_pb2.PullRequest(
                trainer_id=0, min_step=0, names=sorted(e.blocks), layout_digest=e.digest, session=own
            )
        ),  # read-only
        "Prefetch": prefetch_stream(e, PREFETCH_CHUNK),  # read-only (no row is stored)
        "PushPull": push_stream(e, STREAM_CHUNK),  # step 5: from the future
        "PushPullOne": push_stream(e, ONE_MESSAGE),
        "PushPullShared": shared_push(e),
        "PrefetchOne": prefetch_stream(e, ONE_MESSAGE),
        "SaveTables": s(
            ps_pb2.SaveTablesRequest(
                trainer_id=0, directory=str(e.tmp / "tables"), layout_digest=WRONG_DIGEST, session=own
            )
        ),
        "Close": s(ps_pb2.CloseRequest(trainer_id=TRAINERS, session=own)),  # out of range
        "Heartbeat": s(ps_pb2.HeartbeatRequest(trainer_id=0, session=own)),  # a sign of life only
        "Restore": s(
            ps_pb2.RestoreRequest(
                trainer_id=0, checkpoint_step=7, token="x", layout_digest=e.digest, session=own
            )
        ),
        "Checkpoint": s(ps_pb2.CheckpointRequest(trainer_id=0, layout_digest=WRONG_DIGEST, session=own)),
        "Stats": s(ps_pb2.StatsRequest()),
        "Reduce": s(
            ps_pb2.ReduceRequest(
                trainer_id=0,
                layout_digest=WRONG_DIGEST,
                session=own,
                key="auc",
                op="sum",
                values=[ps_pb2.ReduceValue(name="pos", shape=[3], data=[1.0, 2.0, 3.0])],
            )
        ),
        # Backup trainers' claim, to a pserver that does not decide (none set): refused.
        "Claim": s(ps_pb2.ClaimRequest(trainer_id=0, layout_digest=e.digest, session=own, step=0)),
        # Hot standby's calls, to a pserver without replicas: refused (Lead only reads).
        "Replicate": replica_stream(e, STREAM_CHUNK),
        "ReplicateOne": replica_stream(e, ONE_MESSAGE),
        "Snapshot": s(ps_pb2.SnapshotRequest(replica_id="r", endpoint="127.0.0.1:1", epoch=1)),
        "Follow": s(ps_pb2.FollowRequest(replica_id="r", epoch=1)),
        "Lead": s(ps_pb2.LeadRequest()),
    }


def replica_stream(e: Env, chunk: int) -> List[bytes]:
    """A primary's update message (the step's gradient of every block) as a backup would receive it."""
    header = ps_pb2.ReplicaHeader(epoch=1, seq=1, step=1, lr_step=0, roster='{"trainers": {}, "closed": []}')
    return list(encode_chunks(header, e.grads, chunk))


def legit_change(e: Env, name: str, messages: List[bytes]) -> Optional[str]:
    """Why a (mutated) request may legitimately change the pserver's state; None if it may not."""
    method = METHODS[name]
    if not messages:
        return None

    def speaks_for_trainer(request) -> bool:
        # Only a trainer's own session speaks for it: without it nothing may change.
        t = request.trainer_id
        return 0 <= t < TRAINERS and request.session == e.sessions[t]

    try:
        pushed = messages[0]
        if method.input_type.name == "SharedPush":  # the push is what the named region holds, if ours
            shared = ps_pb2.SharedPush.FromString(pushed)
            request, length, _ = e.shared
            if shared.request.name != request.name:
                return None
            pushed = bytes(request.view[: min(length, shared.request_bytes)])
        if method.input_type.name in ("PushChunk", "SharedPush"):
            header, _ = decode_chunk(pushed, ps_pb2.PushHeader)
            if (
                header is not None
                and speaks_for_trainer(header)
                and header.layout_digest == e.digest
                and header.step == e.server.engine.step
            ):
                return "a push for the current step: it may be counted"
            return None
        request = GetMessageClass(method.input_type).FromString(messages[0])
    except Exception:  # not a valid request: the pserver must refuse it
        return None
    digest_ok = getattr(request, "layout_digest", e.digest) == e.digest
    if name == "Close" and speaks_for_trainer(request):
        return "closes a live trainer"
    if name == "Checkpoint" and digest_ok and speaks_for_trainer(request):
        return "writes a checkpoint"
    if name == "Reduce" and digest_ok and speaks_for_trainer(request):
        return "opens a round of a reduction (and waits for the other trainer)"
    if (
        name == "SaveTables"
        and digest_ok
        and speaks_for_trainer(request)
        and request.directory
        and not request.directory.startswith(str(e.tmp))
    ):
        return "writes table files outside the test's directory"
    return None
