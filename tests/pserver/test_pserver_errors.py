"""Bad input is refused with a clear status and changes nothing; waits end with named errors."""

import math
import time

import grpc
import pytest
import torch

from harness.cluster import LocalCluster
from harness.models import batches, odd_mlp
from harness.ports import free_ports
from psproto import ps_pb2, ps_pb2_grpc
from psproto.codec import encode_chunks
from tests.helpers.polling import poll
from tests.helpers.wire import answer, expect_refusal, open_sessions, push_messages
from trainer import PserverError, PserverUnavailableError, Trainer
from transpiler import DistributeTranspiler, DistributeTranspilerConfig, Program


def program():
    return Program(odd_mlp(), "momentum", lr=0.1)


@pytest.fixture
def cluster():
    config = DistributeTranspilerConfig(barrier_timeout=2.0)
    with LocalCluster(program, 1, 2, config=config) as c:
        yield c


@pytest.fixture
def stub(cluster):
    with grpc.insecure_channel(cluster.endpoints[0]) as channel:
        yield ps_pb2_grpc.ParameterServerStub(channel)


def snapshot(cluster):
    return {n: b.detach().clone() for n, b in cluster.servers[0].engine.store.blocks.items()}


def full_grads(cluster, value=0.5):
    """A gradient for every block, matrices first."""
    store = cluster.servers[0].engine.store
    specs = sorted(store.specs.items(), key=lambda kv: -len(kv[1].shape))
    return [(n, torch.full(spec.shape, value)) for n, spec in specs]


@pytest.mark.timeout(30)
def test_bad_pushes_are_refused_and_change_nothing(cluster, stub):
    digest = cluster.servers[0].program.layout_digest
    sessions = open_sessions(stub, digest)
    before = snapshot(cluster)
    grads = full_grads(cluster)
    name0, g0 = grads[0]
    bad_shape = [(name0, torch.zeros(g0.shape[0] + 1, *g0.shape[1:]))] + grads[1:]
    bad_dtype = [(name0, g0.double())] + grads[1:]
    nan = [(name0, g0.clone().fill_(math.nan))] + grads[1:]
    inf = [(name0, g0.clone().fill_(math.inf))] + grads[1:]
    push = lambda **kw: push_messages(digest, sessions=sessions, **kw)  # noqa: E731
    truncated = list(push(tensors=grads))
    last = truncated[-1].pieces[-1]
    last.data = last.data[:-4]
    cases = [
        (push(tensors=grads, header=False), grpc.StatusCode.INVALID_ARGUMENT, "must open with a header"),
        (
            push_messages("0123", tensors=grads, sessions=sessions),
            grpc.StatusCode.FAILED_PRECONDITION,
            "plan mismatch",
        ),
        (push(trainer_id=2, tensors=grads), grpc.StatusCode.INVALID_ARGUMENT, "trainer id 2 is out of range"),
        (push(trainer_id=-1, tensors=grads), grpc.StatusCode.INVALID_ARGUMENT, "out of range"),
        (push(step=-3, tensors=grads), grpc.StatusCode.INVALID_ARGUMENT, "step must be >= 0"),
        (push(step=5, tensors=grads), grpc.StatusCode.FAILED_PRECONDITION, "from the future"),
        (
            push(tensors=[("nope.block0", torch.zeros(3))]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "unknown tensor 'nope.block0'",
        ),
        (push(tensors=bad_shape), grpc.StatusCode.INVALID_ARGUMENT, "shape"),
        (push(tensors=bad_dtype), grpc.StatusCode.INVALID_ARGUMENT, "dtype 'float64', expected 'float32'"),
        (push(tensors=nan), grpc.StatusCode.INVALID_ARGUMENT, "NaN or Inf"),
        (push(tensors=inf), grpc.StatusCode.INVALID_ARGUMENT, "NaN or Inf"),
        (iter(truncated), grpc.StatusCode.INVALID_ARGUMENT, "stream moved on"),
        # Valid pushes for the current step, but not from trainer 0's own process.
        (
            push(tensors=grads, session=""),
            grpc.StatusCode.FAILED_PRECONDITION,
            "for trainer 0 without a session",
        ),
        (
            push(tensors=grads, session=sessions[1]),
            grpc.StatusCode.ABORTED,
            "trainer 0's session is not known here",
        ),
    ]
    for messages, code, match in cases:
        expect_refusal(lambda: answer(stub.PushPull(messages, timeout=10)), code, match)
    after = snapshot(cluster)
    engine = cluster.servers[0].engine
    assert engine.step == 0 and not engine.pending.trainers and not engine.pending.touched
    for name in before:
        assert torch.equal(before[name], after[name]), name
    # ...and the pserver still serves: a complete, valid step goes through.
    first = stub.PushPull(push_messages(digest, 0, 0, grads, sessions=sessions), timeout=10)
    second = stub.PushPull(push_messages(digest, 1, 0, grads, sessions=sessions), timeout=10)
    reply = answer(first)
    assert reply.counted
    reply = answer(second)
    assert reply.counted and reply.step == 1
    moved = snapshot(cluster)
    assert not torch.equal(moved[name0], before[name0])


@pytest.mark.timeout(30)
def test_duplicate_push_is_acknowledged_not_applied(cluster, stub):
    digest = cluster.servers[0].program.layout_digest
    sessions = open_sessions(stub, digest)
    grads = full_grads(cluster)
    engine = cluster.servers[0].engine
    # Each call waits for the step once its push is counted (or acknowledged): one more parked wait.
    first = stub.PushPull(push_messages(digest, 0, 0, grads, sessions=sessions), timeout=10)
    poll(lambda: engine.waits.parked == 1, "trainer 0's push counted")
    # A retry while the step is still open, and after it was applied.
    retry = stub.PushPull(push_messages(digest, 0, 0, grads, sessions=sessions), timeout=10)
    poll(lambda: engine.waits.parked == 2, "trainer 0's retry acknowledged")
    second = stub.PushPull(push_messages(digest, 1, 0, grads, sessions=sessions), timeout=10)
    assert answer(first).counted
    assert not answer(retry).counted
    assert answer(second).step == 1
    after_one = snapshot(cluster)
    for trainer_id in (0, 1):
        reply = answer(
            stub.PushPull(push_messages(digest, trainer_id, 0, grads, sessions=sessions), timeout=10)
        )
        assert not reply.counted and reply.step == 1
    after_retries = snapshot(cluster)
    for name in after_one:
        assert torch.equal(after_one[name], after_retries[name])
    # One sync step of momentum SGD from w0 with mean grad 0.5: w0 - 0.1 * 0.5.
    name, _ = grads[0]
    initial = cluster.transpiler().get_startup_program(cluster.endpoints[0]).tensors[name]
    torch.testing.assert_close(after_one[name], initial - 0.05)


@pytest.mark.timeout(30)
def test_bad_pulls_and_hellos_are_refused(cluster, stub):
    digest = cluster.servers[0].program.layout_digest
    session = open_sessions(stub, digest, [0])[0]

    def pull(**kw):
        request = ps_pb2.PullRequest(**{"layout_digest": digest, "session": session, **kw})
        return list(stub.Pull(request, timeout=10))

    expect_refusal(
        lambda: pull(names=["fc9.weight.block0"]), grpc.StatusCode.INVALID_ARGUMENT, "unknown blocks"
    )
    expect_refusal(lambda: pull(min_step=7), grpc.StatusCode.FAILED_PRECONDITION, "can only reach 1 next")
    expect_refusal(lambda: pull(trainer_id=9), grpc.StatusCode.INVALID_ARGUMENT, "out of range")
    expect_refusal(lambda: pull(layout_digest="x"), grpc.StatusCode.FAILED_PRECONDITION, "plan mismatch")
    expect_refusal(lambda: pull(session=""), grpc.StatusCode.FAILED_PRECONDITION, "without a session")
    expect_refusal(
        lambda: stub.Hello(ps_pb2.HelloRequest(trainer_id=0, layout_digest="x", incarnation=3), timeout=10),
        grpc.StatusCode.FAILED_PRECONDITION,
        "plan mismatch",
    )
    expect_refusal(
        lambda: stub.Hello(ps_pb2.HelloRequest(trainer_id=1, layout_digest=digest), timeout=10),
        grpc.StatusCode.INVALID_ARGUMENT,
        "needs the trainer process's incarnation",
    )
    expect_refusal(
        lambda: stub.Close(ps_pb2.CloseRequest(trainer_id=5), timeout=10),
        grpc.StatusCode.INVALID_ARGUMENT,
        "out of range",
    )
    assert stub.Stats(ps_pb2.StatsRequest(), timeout=10).step == 0


@pytest.mark.timeout(30)
def test_trainer_with_a_different_plan_is_refused_by_name(cluster):
    t = DistributeTranspiler(DistributeTranspilerConfig(barrier_timeout=2.0))
    t.transpile(0, program=Program(odd_mlp(), "adam", lr=0.1), pservers=cluster.endpoints, trainers=2)
    with pytest.raises(PserverError, match=f"pserver {cluster.endpoints[0]}: refused Hello.*plan mismatch"):
        Trainer(t.get_trainer_program())


@pytest.mark.timeout(30)
def test_sync_barrier_timeout_names_missing_trainer_and_step(cluster):
    barrier_timeout = cluster.config.barrier_timeout
    tr = cluster.trainer(0)
    try:
        x = torch.randn(4, 37)
        tr.model(x).sum().backward()
        start = time.monotonic()
        with pytest.raises(PserverError) as info:
            tr.step()
        elapsed = time.monotonic() - start
        message = str(info.value)
        assert cluster.endpoints[0] in message
        assert "step 0 still waits for trainers [1]" in message and "DEADLINE_EXCEEDED" in message
        # The promise: the step waited the whole barrier_timeout for trainer 1 (the pserver's deadline starts
        # after `start`). That the pserver's barrier ended the wait, and not the trainer's own RPC deadline
        # (barrier_timeout + rpc_timeout), the message above shows: only the barrier names who is missing.
        assert elapsed >= barrier_timeout
    finally:
        tr.close()


@pytest.mark.timeout(60)
def test_pserver_that_never_comes_up_is_named_within_the_deadline():
    from pserver import ParameterServer

    live, dead = (f"127.0.0.1:{p}" for p in free_ports(2))
    # recovery_timeout: the longer wait a joining trainer has (for pservers that disagree), which an
    # unreachable one must not get; set below the test's timeout, so that a trainer taking it fails here.
    config = DistributeTranspilerConfig(connect_timeout=2.0, recovery_timeout=40.0)
    t = DistributeTranspiler(config)
    t.transpile(0, program=program(), pservers=[live, dead], trainers=1)
    with ParameterServer(t.get_pserver_program(live), t.get_startup_program(live)):
        start = time.monotonic()
        with pytest.raises(PserverUnavailableError) as info:
            Trainer(t.get_trainer_program())
        elapsed = time.monotonic() - start
    assert f"pserver {dead}: did not come up within 2s" in str(info.value)
    # The promise: a pserver that never comes up is named once connect_timeout has passed (the trainer's
    # Hello deadline starts after `start`), well before recovery_timeout: halfway between the two.
    assert config.connect_timeout <= elapsed < (config.connect_timeout + config.recovery_timeout) / 2


@pytest.mark.timeout(30)
def test_second_pserver_on_the_same_port_fails_to_bind(cluster):
    from pserver import ParameterServer

    t = cluster.transpiler()
    ep = cluster.endpoints[0]
    with pytest.raises(OSError, match=f"cannot bind {ep}"):
        ParameterServer(t.get_pserver_program(ep), t.get_startup_program(ep)).start()


@pytest.mark.timeout(30)
def test_push_pull_retry_is_acknowledged_not_applied_and_still_answers(cluster):
    """The trainers' PushPull: a retried step is not applied twice; its answer is the blocks."""
    from psproto.codec import TensorReader, decode_chunk

    digest = cluster.servers[0].program.layout_digest
    store = cluster.servers[0].engine.store
    grads = full_grads(cluster)
    with grpc.insecure_channel(cluster.endpoints[0]) as channel:
        push_pull = channel.unary_unary("/psproto.ParameterServer/PushPullOne")

        sessions = open_sessions(ps_pb2_grpc.ParameterServerStub(channel), digest)

        def call(trainer_id):
            header = ps_pb2.PushHeader(
                trainer_id=trainer_id, step=0, layout_digest=digest, session=sessions[trainer_id]
            )
            (message,) = encode_chunks(header, grads, 1 << 30)
            reader, header = TensorReader(store.expect), None
            for data in (push_pull(message, timeout=10),):  # one message each way
                h, pieces = decode_chunk(data, ps_pb2.PullHeader)
                header = header or h
                for piece in pieces:
                    reader.add(piece)
            return header, reader.finish()

        import threading

        answers = []
        first = threading.Thread(target=lambda: answers.append(call(0)))  # sync: answers once 1 pushed
        first.start()
        header, blocks = call(1)
        first.join(10)
        assert header.counted and header.step == 1
        assert answers and answers[0][0].counted and answers[0][0].step == 1
        applied_once = snapshot(cluster)
        header, blocks = call(1)  # a retry of step 0
        assert not header.counted and header.step == 1
    assert all(torch.equal(applied_once[n], snapshot(cluster)[n]) for n in applied_once)
    assert blocks.keys() == applied_once.keys()
    assert all(torch.equal(blocks[n], applied_once[n]) for n in blocks)


@pytest.mark.timeout(60)
def test_pserver_exits_when_a_dead_trainer_never_rejoins():
    """Trainer 1 dies without closing: dropped after heartbeat_timeout, counted as closed after
    trainer_rejoin_timeout, so the pserver finishes once trainer 0 closes."""
    config = DistributeTranspilerConfig(
        heartbeat_interval=0.1, heartbeat_timeout=0.5, trainer_rejoin_timeout=0.5, barrier_timeout=30
    )
    with LocalCluster(program, 1, 2, config=config) as c:
        dead = c.trainer(1)
        dead._heartbeat.stop()  # the process "dies": no close, no heartbeat
        dead.channels.shutdown()
        with c.trainer(0) as tr:
            x, y = batches(2, 4, 1)[0][0]
            torch.nn.functional.cross_entropy(tr.model(x), y).backward()
            tr.step()  # completes once trainer 1 is dropped
        assert c.servers[0].wait(timeout=20)  # every trainer closed or counted closed
        assert c.servers[0].engine.roster.closed == {0, 1}
