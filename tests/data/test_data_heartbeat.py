"""A trainer's heartbeat on the data channel (trainer/transport/channel.py, pserver/data/calls.py): it goes
over the push-pulls' connection where the pserver has a data port, is noted and counted as gRPC's is and
answers the same step and incarnation, sends nothing while a call is in flight there, and falls back to
gRPC where that connection broke or the data port does not answer within a heartbeat_interval."""

from __future__ import annotations

import threading
import time
from typing import NamedTuple

import pytest

from harness.cluster import LocalCluster
from harness.models import odd_mlp
from trainer.errors import FencedError
from transpiler import DistributeTranspilerConfig, Program

INTERVAL = 0.5


def program() -> Program:
    return Program(odd_mlp(), "sgd", lr=0.1)


@pytest.fixture(params=[20.0], ids=["quiet"])
def cluster(request):
    """A pserver and a trainer with ``heartbeat_interval`` 20 s (a data heartbeat has that long before it
    goes to gRPC: no fallback however busy the machine), or ``INTERVAL`` (``short``)."""
    config = DistributeTranspilerConfig(heartbeat_interval=request.param, heartbeat_timeout=30.0)
    with LocalCluster(program, 1, 1, config=config) as cluster:
        yield cluster


def grpc_heartbeats(channel) -> list:
    """The gRPC Heartbeats ``channel`` sends from now on, as a list that grows."""
    sent, unary = [], channel._unary

    def counted(method, *args, **kwargs):
        if method == "Heartbeat":
            sent.append(time.monotonic())
        return unary(method, *args, **kwargs)

    channel._unary = counted
    return sent


class Beating(NamedTuple):
    """The pserver, its trainer's channel to it, and the gRPC heartbeats that channel sent."""

    server: object
    channel: object
    over_grpc: list


@pytest.fixture
def beating(cluster):
    """Trainer 0 said Hello; its own heartbeat thread stopped, so a test's heartbeats are its own."""
    server = cluster.servers[0]
    with cluster.trainer(0) as tr:
        tr._heartbeat.stop()
        channel = tr.channels[cluster.endpoints[0]]
        yield Beating(server, channel, grpc_heartbeats(channel))


@pytest.mark.timeout(60)
def test_a_heartbeat_goes_over_the_data_channel_and_is_heard_as_gRPC_s(beating):
    server, channel, over_grpc = beating
    server.engine.roster.last_seen[0] -= 60  # silent for a minute
    before = server.servicer.counters.heartbeats
    reply = channel.heartbeat(timeout=10)
    assert not over_grpc
    assert (reply.step, reply.incarnation) == (server.engine.step, server.servicer.incarnation)
    assert server.servicer.counters.heartbeats == before + 1
    assert time.monotonic() - server.engine.presence(0)[0] < 10
    assert channel.data_connections >= 1


@pytest.mark.timeout(60)
def test_no_heartbeat_goes_while_a_call_is_in_flight_on_the_connection(beating):
    server, channel, over_grpc = beating
    busy = channel._link.data._busy.setdefault(0, threading.Lock())
    before = server.servicer.counters.heartbeats
    with busy:  # the step thread's call holds the connection
        reply = channel.heartbeat(timeout=10)
    assert reply.step == -1 and not over_grpc
    assert server.servicer.counters.heartbeats == before


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cluster", [INTERVAL], ids=["short"], indirect=True)
def test_a_data_port_that_does_not_answer_within_an_interval_leaves_the_heartbeat_to_gRPC(beating):
    server, channel, over_grpc = beating
    calls = server._data_port.calls
    stalled, released = threading.Event(), threading.Event()
    beat = calls._heartbeat

    def stalling(*args):  # the reactor is held, as a long checkpoint under the engine's lock holds it
        stalled.set()
        released.wait(30)
        yield from beat(*args)

    calls._heartbeat = stalling
    started = time.monotonic()
    try:
        reply = channel.heartbeat(timeout=10)
        took = time.monotonic() - started
        assert stalled.is_set() and not released.is_set()
    finally:
        released.set()
    assert reply.incarnation == server.servicer.incarnation
    assert over_grpc and over_grpc[0] - started >= INTERVAL  # gRPC's, after an interval's wait
    assert took < 10
    calls._heartbeat = beat
    before = len(over_grpc)
    reply = channel.heartbeat(timeout=10)  # on a new data connection: the one that timed out was closed
    assert reply.incarnation == server.servicer.incarnation and reply.step >= 0
    assert len(over_grpc) == before


@pytest.mark.timeout(60)
def test_a_heartbeat_of_a_fenced_session_is_refused_as_gRPC_refuses_it(beating):
    server, channel, over_grpc = beating
    channel.heartbeat(timeout=10)  # the data connection is open
    # A newer process takes trainer 0 over (the old one silent, dropped): the old session is fenced.
    server.servicer.sessions.hello(0, 12345, "a newer process", time.monotonic() - 3600, ended=True)
    with pytest.raises(FencedError):
        channel.heartbeat(timeout=10)
    assert not over_grpc
