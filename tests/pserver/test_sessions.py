"""Sessions: who may speak for a trainer id. Pure decisions (tables), then the servicer with a fake context.

The process-level behaviour (a duplicate trainer refused within seconds, a fenced
old process exiting, stray messages on a live job) is in tests/recovery/test_fencing.py.
"""

from __future__ import annotations

import re
import time

import grpc
import pytest
import torch

from pserver.errors import AlreadyRunning, Fenced, MustResync, NoSession
from pserver.rpc import sessions as S
from pserver.rpc.sessions import Session, Sessions, on_call, on_hello
from psproto import ps_pb2
from psproto.codec import encode_chunks
from tests.helpers.servicer import EP, Aborted, FakeContext, method_of, push_pulls, servicer

NOW, WINDOW = 1000.0, 6.0
LIVE = Session(token="a" * 32, incarnation=1, peer="ipv4:127.0.0.1:1111", opened=NOW - 100)


@pytest.mark.parametrize(
    "current, incarnation, last_heard, ended, expected",
    [
        (None, 1, None, False, S.OPEN),  # a new id
        (None, 2, NOW - 1, False, S.OPEN),  # this pserver restarted: no sessions
        (LIVE, 1, NOW - 1, False, S.KEEP),  # the same process re-syncs
        (LIVE, 1, NOW - 500, True, S.KEEP),  # ... even after a drop or a close
        (LIVE, 2, NOW - 1, False, S.REFUSE),  # a second process while the first lives
        (LIVE, 2, NOW - WINDOW, False, S.REFUSE),  # heard from exactly one window ago: alive
        (LIVE, 2, NOW - WINDOW - 0.1, False, S.TAKE_OVER),  # silent longer: a restart takes over
        (LIVE, 2, NOW - 1, True, S.TAKE_OVER),  # closed or dropped: taken over at once
        (LIVE, 2, None, False, S.TAKE_OVER),  # never heard from, opened long ago
        (Session("b" * 32, 1, "p", NOW - 1), 2, None, False, S.REFUSE),  # its Hello is under way
    ],
)
def test_hello_decisions(current, incarnation, last_heard, ended, expected):
    assert on_hello(current, incarnation, last_heard, ended, NOW, WINDOW) == expected


@pytest.mark.parametrize(
    "current, token, fenced, expected",
    [
        (LIVE, "a" * 32, False, S.OK),
        (LIVE, "", False, S.NO_SESSION),
        (None, "", False, S.NO_SESSION),
        (LIVE, "b" * 32, True, S.FENCED),
        (LIVE, "b" * 32, False, S.UNKNOWN),
        (LIVE, "A" * 32, False, S.UNKNOWN),
        (LIVE, "a" * 31, False, S.UNKNOWN),
        (None, "a" * 32, False, S.UNKNOWN),  # this pserver restarted
        (LIVE, "\u00e9\u00e9", False, S.UNKNOWN),  # non-ASCII: an answer, not an exception
        (LIVE, "\0", False, S.UNKNOWN),
    ],
)
def test_call_verdicts(current, token, fenced, expected):
    assert on_call(current, token, fenced) == expected


def test_sessions_open_keep_refuse_take_over_and_fence():
    s = Sessions(EP, alive_window=0.5)
    first = s.hello(1, incarnation=11, peer="ipv4:127.0.0.1:1001", last_heard=None, ended=False)
    assert re.fullmatch(r"[0-9a-f]{32}", first)
    assert s.hello(1, 11, "ipv4:127.0.0.1:1001", time.monotonic(), False) == first  # the same process
    s.check(1, first)
    with pytest.raises(AlreadyRunning) as info:
        s.hello(1, 12, "ipv4:127.0.0.1:2002", time.monotonic(), False)
    message = str(info.value)
    assert f"pserver {EP}: trainer 1 is already running" in message
    assert (
        "opened from ipv4:127.0.0.1:1001" in message and "this Hello came from ipv4:127.0.0.1:2002" in message
    )
    s.check(1, first)  # the refusal changed nothing
    # The first process goes silent past the window: a restarted one takes the id over.
    second = s.hello(1, 12, "ipv4:127.0.0.1:2002", time.monotonic() - 1.0, False)
    assert second != first
    s.check(1, second)
    with pytest.raises(Fenced, match=r"fenced: trainer 1 rejoined \(a new process from ipv4:127.0.0.1:2002"):
        s.check(1, first)
    with pytest.raises(MustResync, match="trainer 0's session is not known here"):
        s.check(0, second)  # another trainer's token
    with pytest.raises(MustResync):
        s.check(0, first)  # fenced for trainer 1, not 0
    with pytest.raises(NoSession, match="a call for trainer 1 without a session"):
        s.check(1, "")


def test_tokens_are_unguessable_and_fenced_ones_are_bounded(monkeypatch):
    # Unguessable means drawn from the OS's CSPRNG (the secrets module), at least 128 bits: a
    # token from random, a counter or the clock would still be unique, and forgeable.
    drawn, inside = [], []

    def spy(real):
        def draw(nbytes=None):
            inside.append(real.__name__)  # token_hex draws through token_bytes: count the outer call
            try:
                out = real(nbytes)
            finally:
                inside.pop()
            if not inside:
                drawn.append((real.__name__, nbytes, out))
            return out

        return draw

    for name in ("token_hex", "token_urlsafe", "token_bytes"):
        monkeypatch.setattr(S.secrets, name, spy(getattr(S.secrets, name)))
    s = Sessions(EP, alive_window=0.0)
    tokens = [
        s.hello(0, incarnation=i + 1, peer="p", last_heard=None, ended=True) for i in range(S.FENCED_KEPT + 5)
    ]
    assert len(drawn) == len(tokens), "a session token not drawn from the secrets module"
    assert all(nbytes is not None and nbytes >= 16 for _, nbytes, _ in drawn), {d[:2] for d in drawn}
    assert [out for _, _, out in drawn] == tokens
    # The same process's Hello again keeps its token: nothing new is drawn.
    assert (
        s.hello(0, incarnation=len(tokens), peer="p", last_heard=time.monotonic(), ended=False) == tokens[-1]
    )
    assert len(drawn) == len(tokens)
    # 128 bits as 32 hex digits, every digit seen at every position over this many tokens.
    assert all(re.fullmatch(r"[0-9a-f]{32}", t) for t in tokens), tokens[:3]
    assert all({t[i] for t in tokens} == set("0123456789abcdef") for i in range(32))
    assert len(set(tokens)) == len(tokens)
    with pytest.raises(Fenced):
        s.check(0, tokens[-2])
    with pytest.raises(MustResync):  # forgotten: the oldest fenced token
        s.check(0, tokens[0])


# -- through the servicer: a call without the trainer's session changes nothing -----------------


def hello(svc, trainer_id, incarnation, peer="ipv4:127.0.0.1:40000"):
    request = ps_pb2.HelloRequest(
        trainer_id=trainer_id, layout_digest=svc.layout_digest, incarnation=incarnation
    )
    return svc.control.Hello(request.SerializeToString(), FakeContext(peer))


def refused(svc, method, request, messages=None):
    """(code, details) of a refused call, its bytes or its stream of push chunks."""
    context = FakeContext()
    with pytest.raises(Aborted):
        answer = method_of(svc, method)(
            messages if messages is not None else request.SerializeToString(), context
        )
        if hasattr(answer, "__next__"):
            list(answer)
    return context.aborted


def push(svc, trainer_id, session, step=0):
    grads = [(n, torch.full(shape, 0.5)) for n, (_, shape) in svc.contents.block_layout().items()]
    header = ps_pb2.PushHeader(
        trainer_id=trainer_id, step=step, layout_digest=svc.layout_digest, session=session
    )
    return iter(list(encode_chunks(header, grads, 1 << 20)))


def engine_state(svc):
    e = svc.engine
    return (
        e.step,
        set(e.pending.trainers),
        set(e.roster.closed),
        set(e.roster.dropped),
        dict(e.roster.last_step),
        dict(e.roster.last_seen),
    )


def test_calls_without_the_session_are_refused_and_change_nothing():
    svc = servicer()
    live = {t: hello(svc, t, incarnation=100 + t).session for t in (0, 1)}
    before = engine_state(svc)
    digest = svc.layout_digest
    for token, code in (
        ("", grpc.StatusCode.FAILED_PRECONDITION),
        ("f" * 32, grpc.StatusCode.ABORTED),
        (live[1], grpc.StatusCode.ABORTED),
    ):
        for method, request in (
            ("Close", ps_pb2.CloseRequest(trainer_id=0, session=token)),
            ("Heartbeat", ps_pb2.HeartbeatRequest(trainer_id=0, session=token)),
            ("Checkpoint", ps_pb2.CheckpointRequest(trainer_id=0, layout_digest=digest, session=token)),
            ("Pull", ps_pb2.PullRequest(trainer_id=0, layout_digest=digest, session=token)),
        ):
            got, details = refused(svc, method, request)
            assert got == code and "trainer 0" in details, (method, token, details)
        for method, messages in (
            ("PushPullOne", next(push(svc, 0, token))),
            ("PushPull", push(svc, 0, token)),
        ):
            got, details = refused(svc, method, None, messages)
            assert got == code, (method, details)
    got, details = refused(svc, "Close", None, b"")  # the stray message: empty bytes
    assert got == grpc.StatusCode.FAILED_PRECONDITION and "trainer 0 without a session" in details
    assert engine_state(svc) == before  # not even a sign of life was noted
    assert svc.counters.refused == 3 * 6 + 1
    # The live trainers' own calls still go through.
    first, second = push_pulls(svc, push(svc, 0, live[0]), push(svc, 1, live[1]))
    assert first.counted
    assert second.step == 1


def test_a_second_process_is_refused_and_a_restart_fences_the_old_one():
    svc = servicer()
    svc.sessions.alive_window = 0.2
    old = hello(svc, 1, incarnation=5, peer="ipv4:127.0.0.1:5555").session
    zero = hello(svc, 0, incarnation=6).session
    code, details = refused(
        svc, "Hello", ps_pb2.HelloRequest(trainer_id=1, layout_digest=svc.layout_digest, incarnation=7)
    )
    assert code == grpc.StatusCode.ALREADY_EXISTS
    assert "trainer 1 is already running" in details and "opened from ipv4:127.0.0.1:5555" in details
    assert (
        svc.control.Heartbeat(
            ps_pb2.HeartbeatRequest(trainer_id=1, session=old).SerializeToString(), FakeContext()
        ).incarnation
        == svc.incarnation
    )
    # The old process falls silent (a paused VM); its restart takes the id over after the window.
    svc.engine.roster.last_seen[1] -= 1.0
    new = hello(svc, 1, incarnation=7, peer="ipv4:127.0.0.1:7777").session
    assert new != old
    before = engine_state(svc)
    code, details = refused(svc, "PushPull", None, push(svc, 1, old))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert details == (
        f"pserver {EP}: fenced: trainer 1 rejoined (a new process from ipv4:127.0.0.1:7777 took "
        f"the id over after this one went silent); this process must stop instead of pushing "
        f"stale gradients"
    )
    assert engine_state(svc) == before  # the late push was not counted
    assert push_pulls(svc, push(svc, 1, new), push(svc, 0, zero))[0].counted
