"""A pserver servicer without a server: its methods called directly with a fake gRPC context."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import List

import torch
from torch import nn

from pserver.engine import Contents, Reductions, SyncEngine
from pserver.held_elsewhere import HeldElsewhere
from pserver.rpc import PserverServicer
from pserver.store import BlockStore
from pserver.tables.table_set import TableSet
from psproto import ps_pb2
from transpiler import DistributeTranspiler, DistributeTranspilerConfig, Program

EP = "127.0.0.1:1"


class Aborted(Exception):
    """What the fake context's abort raises: grpc's abort never returns either."""


class FakeContext:
    """Records the one ``abort(code, details)`` a servicer method makes."""

    def __init__(self, peer: str = "ipv4:127.0.0.1:40000"):
        self.aborted = None
        self._peer = peer

    def peer(self) -> str:
        return self._peer

    def abort(self, code, details):
        assert self.aborted is None, "aborted twice"
        self.aborted = (code, details)
        raise Aborted(details)


def servicer() -> PserverServicer:
    torch.manual_seed(0)
    t = DistributeTranspiler(DistributeTranspilerConfig())
    t.transpile(0, program=Program(nn.Linear(4, 2), "sgd", lr=0.5), pservers=EP, trainers=2)
    ps = t.get_pserver_program(EP)
    store, tables = BlockStore(ps, t.get_startup_program(EP, ps)), TableSet(ps)
    engine, reductions = wired(store, tables, 2, 5.0)
    return PserverServicer(
        engine,
        Contents(store, tables),
        reductions,
        ps.layout_digest,
        chunk_bytes=1 << 20,
        alive_window=ps.config.session_alive_window,
    )


def push_pulls(svc: PserverServicer, *pushes) -> List[ps_pb2.PullHeader]:
    """PushPull calls of several trainers made at once (a sync step waits for all of them): each answer's
    header."""

    def call(messages) -> ps_pb2.PullHeader:
        return ps_pb2.PullChunk.FromString(list(svc.data.PushPull(messages, FakeContext()))[0]).header

    with ThreadPoolExecutor(len(pushes)) as pool:
        return [f.result(30) for f in [pool.submit(call, m) for m in pushes]]


def open_session(svc: PserverServicer, trainer_id: int = 0) -> str:
    """The session a Hello for ``trainer_id`` opens, as a trainer process gets it."""
    request = ps_pb2.HelloRequest(trainer_id=trainer_id, layout_digest=svc.layout_digest, incarnation=77)
    return svc.control.Hello(request.SerializeToString(), FakeContext()).session


def method_of(svc: PserverServicer, name: str):
    """The servicer method ``name`` (``"Hello"``, ``"Pull"``, ...) of whichever concern answers it."""
    return next(
        getattr(calls, name) for calls in (svc.control, svc.data, svc.standby) if hasattr(calls, name)
    )


def wired(store: BlockStore, tables: TableSet, trainers: int, barrier_timeout: float):
    """(sync engine, Reduce service) wired as ParameterServer wires them (pserver/server.py).

    The engine is handed the notification point of the parts holding calls outside it
    (pserver/held_elsewhere.py); the service, built from the engine, joins it.
    """
    held = HeldElsewhere()
    engine = SyncEngine(
        store,
        tables,
        trainers,
        EP,
        barrier_timeout=barrier_timeout,
        on_roster_change=held.roster_changed,
        held_elsewhere=held.trainers,
    )
    svc = Reductions(
        EP, barrier_timeout, expected=engine.live, admit=engine.check_live, released=engine.touch
    )
    held.join(svc.parked_trainers, svc.roster_changed)
    return engine, svc


def wired_engine(trainers: int, barrier_timeout: float):
    """(sync engine, Reduce service) wired as ParameterServer wires them (pserver/server.py), every trainer
    said Hello.

    The engine tells the service of roster changes and asks it who waits in a round (``held_elsewhere``);
    the service's rounds touch the trainers they release (``released``).
    """
    torch.manual_seed(0)
    t = DistributeTranspiler(DistributeTranspilerConfig())
    t.transpile(0, program=Program(nn.Linear(4, 2), "sgd", lr=0.5), pservers=EP, trainers=trainers)
    ps = t.get_pserver_program(EP)
    store, tables = BlockStore(ps, t.get_startup_program(EP, ps)), TableSet(ps)
    engine, svc = wired(store, tables, trainers, barrier_timeout)
    for trainer_id in range(trainers):
        engine.hello(trainer_id)
    return engine, svc
