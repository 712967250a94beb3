"""A trainer's call is a sign of life on arrival (pserver/rpc/arrival.py), even while it queues for a
thread."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from harness.cluster import LocalCluster
from harness.models import odd_mlp
from pserver.rpc.arrival import CallsInProgress, caller_of
from psproto.wire import TRAINER_METADATA
from tests.helpers.polling import poll
from transpiler import DistributeTranspilerConfig, Program


@pytest.mark.parametrize(
    "metadata, trainers, expected",
    [
        ((), 4, None),  # no metadata: a call of no trainer (ps-stat)
        (None, 4, None),
        ((("authorization", "Bearer x"),), 4, None),
        (((TRAINER_METADATA, "2:77"),), 4, (2, 77)),
        ((("authorization", "Bearer x"), (TRAINER_METADATA, "0:5")), 4, (0, 5)),
        (((TRAINER_METADATA, "4:77"),), 4, None),  # out of the job's range: ignored
        (((TRAINER_METADATA, "-1:77"),), 4, None),
        (((TRAINER_METADATA, "2"),), 4, None),  # no incarnation: ignored
        (((TRAINER_METADATA, "one:77"),), 4, None),  # not numbers: ignored
        (((TRAINER_METADATA, "2:x"),), 4, None),
        (((TRAINER_METADATA, ""),), 4, None),
    ],
)
def test_caller_of(metadata, trainers, expected):
    assert caller_of(metadata, trainers) == expected


def test_only_the_session_holder_s_calls_in_progress_hold_its_id():
    """A second process's Hello, in progress, must not keep the id's silent holder from being taken over."""
    noted = []
    calls = CallsInProgress(
        lambda *caller: noted.append(caller), 4, holds=lambda trainer, incarnation: incarnation == 7
    )
    with calls.serving(((TRAINER_METADATA, "1:8"),)):  # a newcomer with id 1
        assert calls.trainers() == set()
    with calls.serving(((TRAINER_METADATA, "1:7"),)):  # the holder of id 1
        with calls.serving(((TRAINER_METADATA, "1:7"),)):  # two of its calls at once
            assert calls.trainers() == {1}
        assert calls.trainers() == {1}
    assert calls.trainers() == set() and noted == [(1, 7), (1, 7)]


def program() -> Program:
    return Program(odd_mlp(dtype=torch.float64), "sgd", lr=0.1)


@pytest.mark.timeout(60)
def test_a_unary_call_queued_behind_a_busy_pool_is_noted_on_arrival_and_holds_its_trainer(tmp_path):
    """Behind a thousand async pushes a unary call waits in the pool longer than heartbeat_timeout; the
    trainer, waiting for its answer, is not silent (K = 1,024 async dropped whole load generators)."""
    config = DistributeTranspilerConfig(pserver_rpc_workers=1)
    with LocalCluster(program, 1, 2, config=config) as cluster:
        server, endpoint = cluster.servers[0], cluster.endpoints[0]
        with cluster.trainer(1) as tr:
            heard = server.engine.presence(1)[0]
            gate, busy = threading.Event(), threading.Event()
            server._main_port.pool.submit(lambda: (busy.set(), gate.wait(30)))  # the pool's one thread, held
            assert busy.wait(10)
            try:
                done = {}
                call = threading.Thread(
                    target=lambda: done.setdefault("reply", tr.channels[endpoint].save_tables(str(tmp_path)))
                )
                call.start()
                # The call cannot run (no free thread), yet the pserver heard from trainer 1 as it arrived...
                poll(lambda: server.engine.presence(1)[0] > heard, "trainer 1 noted on arrival", timeout=20)
                # ... and holds it while the call waits: a minute after its arrival it is still not silent.
                poll(lambda: 1 in server.engine.held(), "trainer 1 held while its call waits", timeout=20)
                server.engine.roster.last_seen[1] -= 60
                assert server.engine.roster.silent(30.0, server.engine.held(), time.monotonic()) == []
                assert "reply" not in done
            finally:
                gate.set()
            call.join(30)
            assert list(done["reply"].paths) == []  # answered once the thread was free (no tables to save)
            poll(lambda: 1 not in server.engine.held(), "trainer 1 no longer held once answered", timeout=20)
            assert time.monotonic() - server.engine.presence(1)[0] < 10  # the call's end was heard


@pytest.mark.timeout(60)
def test_a_heartbeat_is_answered_on_the_loop_while_every_pool_thread_is_busy():
    """A heartbeat touches memory only: it never waits for the pool (behind async pushes, or a stuck
    handler)."""
    config = DistributeTranspilerConfig(pserver_rpc_workers=1)
    with LocalCluster(program, 1, 2, config=config) as cluster:
        server, endpoint = cluster.servers[0], cluster.endpoints[0]
        with cluster.trainer(1) as tr:
            gate, busy = threading.Event(), threading.Event()
            server._main_port.pool.submit(lambda: (busy.set(), gate.wait(30)))  # the pool's one thread, held
            assert busy.wait(10)
            try:
                server.engine.roster.last_seen[1] -= 60
                before = server.servicer.counters.heartbeats
                reply = tr.channels[endpoint].heartbeat(timeout=10)  # answered while the pool is still held
                assert not gate.is_set()
            finally:
                gate.set()
            assert reply.incarnation == server.servicer.incarnation
            assert server.servicer.counters.heartbeats == before + 1
            assert time.monotonic() - server.engine.presence(1)[0] < 10  # the heartbeat was heard
            assert 1 not in server.engine.held()


@pytest.mark.timeout(60)
def test_a_call_of_another_process_of_the_id_is_not_noted():
    """A restarted trainer's Hello (or a stray duplicate's call) must not pass for the session holder's
    sign of life."""
    # The holder itself stays quiet: no heartbeat for minutes, and none of its calls held when the test
    # looks (a held call reads as heard from now, which would hide what another process's call does).
    quiet = DistributeTranspilerConfig(heartbeat_interval=300, heartbeat_timeout=600)
    with LocalCluster(program, 1, 2, config=quiet) as cluster:
        server = cluster.servers[0]
        with cluster.trainer(1):
            poll(lambda: 1 not in server.engine.held(), "trainer 1's calls answered")
            holder = server.servicer.sessions.incarnation(1)
            server.engine.roster.last_seen[1] -= 60  # the holder fell silent a minute ago
            quiet_since = server.engine.presence(1)[0]
            server._arrived(1, holder + 1)  # another process of trainer 1 calls
            assert server.engine.presence(1)[0] == quiet_since
            server._arrived(1, holder)  # the holder calls
            assert server.engine.presence(1)[0] > quiet_since + 59


@pytest.mark.timeout(60)
def test_a_call_in_progress_holds_its_trainer_until_its_answer_is_made():
    """A pull taken up but not yet answered (its stretch waits for the pool) is no silence; its end is
    heard. (gRPC's pool: the data channel's calls are counted in progress the same way, from its reactors.)"""
    config = DistributeTranspilerConfig(
        pserver_rpc_workers=1, pserver_stretches_on_loop=False, data_channel=False
    )
    with LocalCluster(program, 1, 2, config=config) as cluster:
        server, endpoint = cluster.servers[0], cluster.endpoints[0]
        with cluster.trainer(1) as tr:
            blocks = [b for b in tr.program.blocks if b.endpoint == endpoint]
            shapes = {b.name: (b.dtype, list(b.shape)) for b in blocks}
            answers = {}
            gate, busy = threading.Event(), threading.Event()
            server._main_port.pool.submit(lambda: (busy.set(), gate.wait(30)))  # the pool's one thread, held
            assert busy.wait(10)
            try:
                call = threading.Thread(
                    target=lambda: tr.channels[endpoint].pull(
                        list(shapes),
                        0,
                        shapes.get,
                        lambda name: answers.setdefault(
                            name, torch.empty(shapes[name][1], dtype=torch.float64)
                        ),
                    )
                )
                call.start()
                poll(lambda: 1 in server.engine.held(), "trainer 1 held while its pull is served", timeout=20)
                server.engine.roster.last_seen[1] -= (
                    60  # a minute since its last call arrived: still not silent
                )
                assert server.engine.roster.silent(30.0, server.engine.held(), time.monotonic()) == []
            finally:
                gate.set()
            call.join(30)
            assert sorted(answers) == sorted(shapes)
            poll(lambda: 1 not in server.engine.held(), "trainer 1 no longer held once answered", timeout=20)
            assert time.monotonic() - server.engine.presence(1)[0] < 10  # the answer's end was heard
