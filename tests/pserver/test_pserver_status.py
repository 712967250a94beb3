"""Which gRPC status each refusal gets, decided in the servicer alone; a bug answers INTERNAL, logged.

No server and no processes: servicer methods are called directly with a fake
context that records ``abort(code, details)``.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import logging

import grpc
import pytest

from pserver import errors
from pserver.engine import SyncEngine
from pserver.errors import (
    AlreadyRunning,
    BadRequest,
    BarrierTimeout,
    Fenced,
    Moved,
    MustResync,
    NoSession,
    NotAllowed,
    NotPrimary,
    OutOfSync,
    Refusal,
    ShuttingDown,
    StorageFailed,
    Unauthenticated,
)
from pserver.layout.phases import LayoutStatus
from pserver.rpc import PserverServicer
from pserver.rpc.prologue import STATUS, CallerChecks, status_of
from psproto import ps_pb2
from psproto.codec import WireError
from tests.helpers.servicer import EP, Aborted, FakeContext, method_of, open_session, servicer

EXPECTED = [
    (BadRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (WireError, grpc.StatusCode.INVALID_ARGUMENT),
    (NotAllowed, grpc.StatusCode.FAILED_PRECONDITION),
    (StorageFailed, grpc.StatusCode.FAILED_PRECONDITION),
    (MustResync, grpc.StatusCode.ABORTED),
    (ShuttingDown, grpc.StatusCode.UNAVAILABLE),
    (BarrierTimeout, grpc.StatusCode.DEADLINE_EXCEEDED),
    (NoSession, grpc.StatusCode.FAILED_PRECONDITION),
    (Fenced, grpc.StatusCode.PERMISSION_DENIED),
    (AlreadyRunning, grpc.StatusCode.ALREADY_EXISTS),
    (NotPrimary, grpc.StatusCode.UNAVAILABLE),
    (Moved, grpc.StatusCode.NOT_FOUND),
    (OutOfSync, grpc.StatusCode.OUT_OF_RANGE),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),  # the data port's token check
]


def call(svc: PserverServicer, method: str, request) -> FakeContext:
    """Call ``method`` with ``request``'s bytes, draining a streaming answer; the context afterwards."""
    context = FakeContext()
    with pytest.raises(Aborted):
        answer = method_of(svc, method)(request.SerializeToString(), context)
        if inspect.isgenerator(answer):
            list(answer)
    return context


@pytest.mark.parametrize("kind, code", EXPECTED, ids=[k.__name__ for k, _ in EXPECTED])
def test_each_refusal_kind_has_its_status(kind, code):
    refusal = kind("no", 1, ["127.0.0.1:1"]) if kind is Moved else kind("no")  # "moved" names a layout
    assert status_of(refusal) == code
    assert STATUS[kind] == code


def test_every_refusal_kind_is_in_the_table():
    kinds = {
        c
        for c in vars(errors).values()
        if isinstance(c, type) and issubclass(c, Refusal) and c is not Refusal
    }
    assert kinds == {k for k, _ in EXPECTED if issubclass(k, Refusal)}
    assert kinds <= STATUS.keys()


@pytest.mark.parametrize(
    "error",
    [ValueError("x"), KeyError("x"), RuntimeError("x"), OSError("x"), Refusal("a refusal of no kind")],
    ids=lambda e: type(e).__name__,
)
def test_anything_else_has_no_status(error):
    assert status_of(error) is None


def test_a_bad_request_is_still_a_value_error():
    assert issubclass(BadRequest, ValueError)
    assert BadRequest("why").message == "why"


@pytest.mark.parametrize("method", ["Heartbeat", "Pull"])
@pytest.mark.parametrize(
    "error", [RuntimeError("boom"), ValueError("boom"), KeyError("boom")], ids=lambda e: type(e).__name__
)
def test_an_unexpected_exception_is_internal_and_logged(method, error, caplog, monkeypatch):
    svc = servicer()

    def broken(*args, **kwargs):
        raise error

    # Heartbeat is a plain method, Pull a server-streaming one: both wrappers.
    monkeypatch.setattr(svc.engine, "touch" if method == "Heartbeat" else "read", broken)
    session = open_session(svc)
    request = (
        ps_pb2.HeartbeatRequest(trainer_id=0, session=session)
        if method == "Heartbeat"
        else ps_pb2.PullRequest(trainer_id=0, layout_digest=svc.layout_digest, session=session)
    )
    with caplog.at_level(logging.ERROR, logger="pserver"):
        context = call(svc, method, request)
    code, details = context.aborted
    assert code == grpc.StatusCode.INTERNAL
    assert details.startswith(f"pserver {EP}: internal error in {method}") and "boom" in details
    logged = [r for r in caplog.records if r.name == "pserver.rpc.servicer" and r.exc_info]
    assert len(logged) == 1 and logged[0].exc_info[1] is error
    assert EP in logged[0].getMessage() and method in logged[0].getMessage()
    assert svc.counters.refused == 1


@pytest.mark.parametrize(
    "method, request_, code, details",
    [
        (
            "Heartbeat",
            ps_pb2.HeartbeatRequest(trainer_id=9),
            grpc.StatusCode.INVALID_ARGUMENT,
            f"pserver {EP}: trainer id 9 is out of range [0, 2)",
        ),
        (
            "Hello",
            ps_pb2.HelloRequest(trainer_id=0, layout_digest="x"),
            grpc.StatusCode.FAILED_PRECONDITION,
            f"pserver {EP}: plan mismatch (layout digest 'x'",
        ),
        (
            "Checkpoint",
            ps_pb2.CheckpointRequest(trainer_id=0),
            grpc.StatusCode.FAILED_PRECONDITION,
            f"pserver {EP} has no checkpoint_dir configured",
        ),
        (
            "Restore",
            ps_pb2.RestoreRequest(trainer_id=0, checkpoint_step=1, token="t"),
            grpc.StatusCode.FAILED_PRECONDITION,
            f"pserver {EP} has no checkpoint_dir to roll back from",
        ),
        (
            "SaveTables",
            ps_pb2.SaveTablesRequest(trainer_id=0, directory="a\0b"),
            grpc.StatusCode.INVALID_ARGUMENT,
            f"pserver {EP}: embedded null byte",
        ),
    ],
)
def test_refusals_name_the_pserver_once_and_log_no_traceback(method, request_, code, details, caplog):
    svc = servicer()
    if request_.DESCRIPTOR.fields_by_name.get("layout_digest") and not request_.layout_digest:
        request_.layout_digest = svc.layout_digest
    if request_.DESCRIPTOR.fields_by_name.get("session"):
        request_.session = open_session(svc)
    context = call(svc, method, request_)
    assert context.aborted[0] == code
    assert context.aborted[1].startswith(details) and context.aborted[1].count(f"pserver {EP}") == 1
    assert svc.counters.refused == 1
    assert not [r for r in caplog.records if r.exc_info]


def test_malformed_bytes_are_invalid_argument():
    svc = servicer()
    context = FakeContext()
    with pytest.raises(Aborted):
        svc.control.Heartbeat(b"\xff\xff", context)
    assert context.aborted[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert context.aborted[1].startswith(f"pserver {EP}: malformed HeartbeatRequest")


def test_storage_failures_are_refusals_of_their_own(monkeypatch):
    built = servicer().engine

    class Broken:
        def load(self, step):
            raise ValueError("checkpoint does not fit block weight.block0")

        def save(self, *args):
            raise OSError("disk full")

    engine = SyncEngine(
        built.store, built.tables, built.trainers, built.endpoint, barrier_timeout=5.0, checkpointer=Broken()
    )
    with pytest.raises(StorageFailed, match="cannot roll back to step 3: checkpoint does not fit"):
        engine.restore(0, 3, "t")
    with pytest.raises(StorageFailed, match="checkpoint failed: disk full"):
        engine.checkpoint()
    monkeypatch.setattr(engine.tables, "save", Broken().save)
    with pytest.raises(StorageFailed, match="cannot save tables to 'out': disk full"):
        engine.save_tables("out")


def _imports(module: str) -> set:
    tree = ast.parse(open(importlib.util.find_spec(module).origin).read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize(
    "module",
    [
        "pserver.engine.engine",
        "pserver.engine.modes",
        "pserver.engine.modes.mode",
        "pserver.engine.modes.sync",
        "pserver.engine.modes.backup_steps",
        "pserver.engine.modes.asynchronous",
        "pserver.engine.modes.geo_deltas",
        "pserver.engine.roster",
        "pserver.engine.services.reductions",
        "pserver.engine.services.claims",
        "pserver.engine.liveness",
        "pserver.engine.contents",
        "pserver.engine.stats",
        "pserver.engine.rollback",
        "pserver.engine.pending",
        "pserver.engine.listeners",
        "pserver.errors",
    ],
)
def test_engines_do_not_import_grpc(module):
    # grpc is already loaded in this process, so only the source tells.
    found = sorted(n for n in _imports(module) if n == "grpc" or n.startswith("grpc."))
    assert not found, f"{module} imports {found}"


@pytest.mark.parametrize(
    "caller_epoch, refusal, says",
    [
        (1, Moved, "moved to layout epoch 2: pservers h:1,h:2 replicas h:3,h:4"),  # an earlier layout
        (2, None, ""),
        (3, ShuttingDown, "not yet the caller's 3: ask again"),  # this process has not moved on yet
        (4, BadRequest, "layout epoch 4 is later than the job's"),  # no layout the job ever had
    ],
)
def test_a_caller_of_another_layout_epoch_is_told_where_to_go(caller_epoch, refusal, says):
    status = lambda: LayoutStatus(epoch=3)  # noqa: E731 - the job runs epoch 3; this process serves 2
    checks = CallerChecks(EP, 2, None, None, "d", 2, ["h:1", "h:2"], status, replicas=["h:3", "h:4"])
    if refusal is None:
        checks.epoch(caller_epoch)
        return
    with pytest.raises(refusal, match=says):
        checks.epoch(caller_epoch)
