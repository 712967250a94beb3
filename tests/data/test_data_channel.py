"""The data channel's machinery (listener, reactors, client) on loopback, with calls of the tests' own.

What the pserver's data calls rely on: a connection is accepted only with the job's token (and TLS
when configured), a call's refusal comes back with its status and message, a call parked on a
:class:`~pserver.engine.waits.Parked` handle holds no thread and is answered once another thread ends
the wait, its deadline ends it, a trainer that leaves while its call waits has the wait cancelled,
shared-memory regions carry payloads both ways, a frame that breaks the protocol ends only its
connection, and an inline payload's buffer is a connection's only while its request is read and served.
"""

from __future__ import annotations

import socket
import threading
import time

import grpc
import numpy as np
import pytest

from pserver.data.inbound import InboundConnection, PayloadBuffers
from pserver.data.listener import DataListener
from pserver.data.reactor import Answer, Reactor
from pserver.engine.waits import Waits
from pserver.errors import BadRequest, Fenced
from psproto.dataplane import frames
from psproto.dataplane.access import client_context, server_context, token_matches
from psproto.dataplane.frames import ConnectionHello, RequestHeader
from psproto.security import Security
from psproto.shared_memory import map_region
from tests.helpers.polling import poll
from trainer.transport.data.data_channel import DataCallError, DataChannel

TOKEN = "s3cret-token"
RELEASE_THEN_PARK = 99  # a push of this step gives its payload back, then waits until released


class Calls:
    """The tests' data calls: echo (inline or through the regions), refuse, or park until released."""

    def __init__(self):
        self.cv = threading.Condition()
        self.waits = Waits(self.cv, "127.0.0.1:1", barrier_timeout=1.0)
        self.released = False
        self.parked = []

    def check(self, hello: ConnectionHello) -> None:
        if not token_matches(TOKEN, hello.token):
            raise Fenced("wrong token")

    def serve(self, connection, request):
        header = request.header
        if header.kind == frames.MAP_REGIONS:
            a, b = frames.unpack_regions(bytes(request.payload))
            connection.map_regions(*(map_region(r.pid, r.fd, r.name, r.size) for r in (a, b)))
            yield Answer()
            return
        if header.kind == frames.PREFETCH:
            raise BadRequest("no tables here")
        if header.kind == frames.PULL:  # parks until released
            with self.cv:
                handle = self.waits.park(lambda: self.released, "a test pull", lambda: [1], trainer=0)
                self.parked.append(handle)
            yield handle
            handle.finish()
            yield Answer(step=header.min_step)
            return
        if header.flags & frames.SHARED:
            src = np.frombuffer(connection.regions[0], np.uint8, header.payload_bytes)
            np.frombuffer(connection.regions[1], np.uint8, header.payload_bytes)[:] = src[::-1]
            yield Answer(step=header.step, flags=frames.COUNTED, shared_bytes=header.payload_bytes)
            return
        answer = [request.payload[::-1].copy(), request.step_trainers.copy()]
        if header.step == RELEASE_THEN_PARK:  # what the answer needs copied, the payload given back
            connection.release_payload()
            with self.cv:
                handle = self.waits.park(lambda: self.released, "a test push", lambda: [1], trainer=0)
                self.parked.append(handle)
            yield handle
            handle.finish()
        yield Answer(step=header.step, buffers=answer)

    def release(self):
        with self.cv:
            self.released = True
            self.waits.notify()


@pytest.fixture
def served():
    calls = Calls()
    reactors = [Reactor(f"test-reactor-{i}", calls.serve, send_timeout=5.0) for i in range(2)]
    listener = DataListener("127.0.0.1", 0, max_payload=1 << 24)
    listener.serve(calls.check, reactors)
    yield calls, listener
    listener.close()
    for r in reactors:
        r.stop()


def connect(listener, token=TOKEN, trainer=0, **kw) -> DataChannel:
    hello = ConnectionHello(trainer, 0, 1, token, "session", "digest")
    return DataChannel(("127.0.0.1", listener.port), hello, kw.get("context"), "localhost", 5.0)


def test_a_push_and_its_answer_travel_inline(served):
    _, listener = served
    channel = connect(listener)
    data = np.arange(100_000, dtype=np.uint8)
    header, answer = channel.call(
        RequestHeader(frames.PUSH_PULL, step=4, step_trainers=2, payload_bytes=data.size), [3, 1], [data], 5.0
    )
    assert header.step == 4
    assert np.array_equal(answer[: data.size], data[::-1])
    assert answer[data.size :].view(np.int32).tolist() == [3, 1]
    channel.close()


def test_payloads_travel_through_the_connection_s_regions(served):
    _, listener = served
    channel = connect(listener)
    channel.map_regions(1 << 16, 1 << 16, 5.0)
    data = np.random.default_rng(0).integers(0, 255, 5000, dtype=np.uint8)
    np.frombuffer(channel.regions[0].view, np.uint8, data.size)[:] = data
    header, answer = channel.call(
        RequestHeader(frames.PUSH_PULL, frames.SHARED, step=2, payload_bytes=data.size), (), (), 5.0
    )
    assert header.flags & frames.COUNTED and np.array_equal(answer, data[::-1])
    channel.close()


def test_requests_sent_on_two_connections_before_either_answer_is_read_get_each_its_own(served):
    _, listener = served
    channels = [connect(listener, trainer=t) for t in (0, 1)]
    data = [np.full(1000 * (t + 1), t + 7, dtype=np.uint8) for t in (0, 1)]
    for t, channel in enumerate(channels):
        channel.send(
            RequestHeader(frames.PUSH_PULL, step=t + 3, payload_bytes=data[t].size), (), [data[t]], 5.0
        )
    for t, channel in reversed(list(enumerate(channels))):
        header, answer = channel.receive(5.0)
        assert header.step == t + 3 and np.array_equal(answer, data[t])
        channel.close()


def test_an_inline_payload_s_buffer_goes_back_to_the_port_once_the_request_is_answered(served):
    _, listener = served
    channel = connect(listener)
    data = np.arange(200_000, dtype=np.uint8)
    channel.call(RequestHeader(frames.PUSH_PULL, step=3, payload_bytes=data.size), (), [data], 5.0)
    poll(lambda: listener._payload_buffers.kept_bytes() >= data.size, "the buffer given back")
    (connection,) = listener._by_slot.values()
    assert connection._buffer.size == 0  # an idle connection holds no payload
    channel.close()


def test_a_push_parked_after_giving_its_payload_back_lets_another_connection_read_into_it(served):
    calls, listener = served
    first, second = connect(listener, trainer=0), connect(listener, trainer=1)
    data = [np.full(300_000, 7, dtype=np.uint8), np.full(300_000, 9, dtype=np.uint8)]
    first.send(
        RequestHeader(frames.PUSH_PULL, step=RELEASE_THEN_PARK, payload_bytes=data[0].size),
        (),
        [data[0]],
        5.0,
    )
    poll(lambda: calls.parked, "the first push parked")
    header, answer = second.call(
        RequestHeader(frames.PUSH_PULL, step=5, payload_bytes=data[1].size), (), [data[1]], 5.0
    )
    assert header.step == 5 and np.array_equal(answer, data[1])  # read into the buffer the first gave back
    calls.release()
    header, answer = first.receive(5.0)
    assert header.step == RELEASE_THEN_PARK and np.array_equal(answer, data[0])  # its copy, untouched
    first.close()
    second.close()


@pytest.mark.parametrize(
    "kept, taken, reused",
    [
        ([100], 50, True),  # a kept buffer large enough serves the request
        ([100], 100, True),
        ([100], 101, False),  # none large enough: a new one
        ([], 1, False),
    ],
)
def test_payload_buffers_serve_a_request_from_a_kept_buffer_large_enough(kept, taken, reused):
    buffers = PayloadBuffers(keep=4)
    given = [np.empty(n, np.uint8) for n in kept]
    for b in given:
        buffers.give(b)
    got = buffers.take(taken)
    assert got.size >= taken and any(got is b for b in given) == reused


@pytest.mark.parametrize("reuse, kept", [(True, 4096), (False, 0)])
def test_a_payload_released_for_reuse_goes_back_and_one_whose_views_outlive_it_does_not(reuse, kept):
    # A lane's parts wait for the push's other lanes in views of its payload: that buffer is never reused.
    ours, theirs = socket.socketpair()
    buffers = PayloadBuffers(keep=4)
    connection = InboundConnection(ours, ConnectionHello(0, 0, 1, TOKEN, "s", "d"), "peer", 1 << 20, buffers)
    ours.setblocking(False)
    theirs.sendall(RequestHeader(frames.PUSH_PULL, step=1, payload_bytes=4096).pack() + bytes(4096))
    request = poll(connection.read, "the request read")
    assert request.payload.size == 4096 and buffers.kept_bytes() == 0  # the connection holds it
    connection.release_payload(reuse=reuse)
    assert buffers.kept_bytes() == kept
    connection.served()  # the answer: nothing more to give back
    assert buffers.kept_bytes() == kept
    connection.close()
    theirs.close()


def test_payload_buffers_keep_the_largest_and_free_the_rest():
    buffers = PayloadBuffers(keep=2)
    for n in (10, 30, 20, 5):
        buffers.give(np.empty(n, np.uint8))
    assert buffers.kept_bytes() == 30 + 20


def test_a_connection_without_the_token_is_refused_with_the_status_gRPC_would_give(served):
    _, listener = served
    with pytest.raises(DataCallError) as e:
        connect(listener, token="wrong")
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "wrong token" in e.value.details()


def test_a_refused_call_leaves_the_connection_serving(served):
    _, listener = served
    channel = connect(listener)
    with pytest.raises(DataCallError) as e:
        channel.call(RequestHeader(frames.PREFETCH), (), (), 5.0)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no tables here" in e.value.details()
    header, _ = channel.call(RequestHeader(frames.PUSH_PULL, step=9), (), (), 5.0)
    assert header.step == 9
    channel.close()


def test_a_parked_call_holds_no_reactor_and_is_answered_once_released(served):
    calls, listener = served
    waiting = connect(listener)
    out = {}
    t = threading.Thread(
        target=lambda: out.setdefault("r", waiting.call(RequestHeader(frames.PULL, min_step=7), (), (), 5.0))
    )
    t.start()
    poll(lambda: calls.parked, "the pull parked", timeout=5)
    # Both reactors keep serving while the pull waits.
    others = [connect(listener, trainer=1 + i) for i in range(3)]
    for i, other in enumerate(others):
        assert other.call(RequestHeader(frames.PUSH_PULL, step=i), (), (), 5.0)[0].step == i
    assert t.is_alive()
    calls.release()
    t.join(5)
    assert out["r"][0].step == 7
    for c in [waiting, *others]:
        c.close()


def test_a_parked_call_ends_at_its_deadline_with_the_barrier_s_timeout(served):
    _, listener = served
    channel = connect(listener)
    start = time.monotonic()
    with pytest.raises(DataCallError) as e:
        channel.call(RequestHeader(frames.PULL), (), (), 10.0)
    assert (
        e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        and "still waits for trainers [1]" in e.value.details()
    )
    assert 0.9 <= time.monotonic() - start < 5
    channel.close()


def test_a_trainer_that_leaves_while_its_call_waits_has_the_wait_cancelled(served):
    calls, listener = served
    channel = connect(listener)
    t = threading.Thread(
        target=lambda: pytest.raises(DataCallError, channel.call, RequestHeader(frames.PULL), (), (), 5.0)
    )
    t.start()
    poll(lambda: calls.parked, "the pull parked", timeout=5)
    channel.sock.shutdown(2)
    poll(lambda: calls.parked[0].done, "the parked pull ended", timeout=5)
    assert "went away" in str(calls.parked[0].error)
    t.join(5)
    channel.close()


def test_a_frame_that_breaks_the_protocol_ends_only_its_connection(served):
    _, listener = served
    bad, good = connect(listener), connect(listener, trainer=1)
    bad.sock.sendall(b"\x63" * frames.RequestHeader.SIZE)  # an unknown kind
    assert bad.sock.recv(1) == b""  # closed by the pserver
    assert good.call(RequestHeader(frames.PUSH_PULL, step=1), (), (), 5.0)[0].step == 1
    bad.close()
    good.close()


def test_a_newer_connection_of_a_trainer_s_lane_replaces_the_older(served):
    _, listener = served
    old, new = connect(listener), connect(listener)
    assert old.sock.recv(1) == b""  # the older one is closed
    assert new.call(RequestHeader(frames.PUSH_PULL, step=2), (), (), 5.0)[0].step == 2
    old.close()
    new.close()


def test_tls_with_client_certificates_carries_calls_and_refuses_plaintext(tmp_path):
    from psproto.certs import make_test_certs

    certs = make_test_certs(str(tmp_path))
    server = Security(
        token=TOKEN, tls_cert=certs["server_cert"], tls_key=certs["server_key"], tls_ca=certs["ca"]
    )
    client = Security(
        token=TOKEN,
        tls_ca=certs["ca"],
        tls_client_cert=certs["client_cert"],
        tls_client_key=certs["client_key"],
    )
    calls = Calls()
    reactor = Reactor("tls-reactor", calls.serve, send_timeout=5.0)
    listener = DataListener("127.0.0.1", 0, 1 << 20, server_context(server))
    listener.serve(calls.check, [reactor])
    try:
        channel = connect(listener, context=client_context(client))
        data = np.arange(50_000, dtype=np.uint8)
        header, answer = channel.call(
            RequestHeader(frames.PUSH_PULL, step=3, payload_bytes=data.size), (), [data], 5.0
        )
        assert header.step == 3 and np.array_equal(answer, data[::-1])
        channel.close()
        with pytest.raises(DataCallError):
            connect(listener)  # plaintext to a TLS port
    finally:
        listener.close()
        reactor.stop()


def test_a_connection_the_pserver_closes_while_regions_are_mapped_fails_unavailable():
    """A pserver that goes away (restarted, or a newer connection of the slot) as the trainer maps its
    regions: the call fails UNAVAILABLE, as any broken call does (the trainer heals), never a bare
    ConnectionError."""
    import socket

    server = socket.create_server(("127.0.0.1", 0))

    def accept_hello_then_close():
        conn, _ = server.accept()
        with conn:
            head = conn.recv(ConnectionHello.head_size(), socket.MSG_WAITALL)
            conn.recv(ConnectionHello.rest_size(head), socket.MSG_WAITALL)
            conn.sendall(frames.AnswerHeader().pack())  # hello accepted
            conn.recv(RequestHeader.SIZE, socket.MSG_WAITALL)  # MAP_REGIONS' header: closed unanswered

    thread = threading.Thread(target=accept_hello_then_close)
    thread.start()
    try:
        hello = ConnectionHello(0, 0, 1, TOKEN, "session", "digest")
        channel = DataChannel(("127.0.0.1", server.getsockname()[1]), hello, None, "localhost", 5.0)
        with pytest.raises(DataCallError) as refused:
            channel.map_regions(1 << 16, 1 << 16, 5.0)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert channel.regions is None and channel.sock is None
    finally:
        thread.join(10)
        server.close()
