"""A sync job with more trainers than handler threads: parked pushes hold no thread, so it completes.

Under the threaded server each trainer's PushPull held a handler thread until
its step applied; 12 trainers on 2 threads deadlocked the step. On the asyncio
server (pserver/rpc/aio.py) a parked push holds none: the steps complete, the
model equals single-process training on the concatenated batch (the mean of
the trainers' gradients), and the pserver's threads stay within the pool's bound.
"""

import threading

import grpc
import pytest
import torch

from harness.cluster import LocalCluster
from harness.models import FLOAT64_EXACT, batches, odd_mlp, train_concatenated
from psproto import ps_pb2, ps_pb2_grpc
from psproto.wire import SERVICE, one_message
from tests.helpers.polling import poll
from tests.helpers.wire import answer, open_sessions, push_messages
from transpiler import DistributeTranspilerConfig, Program

TRAINERS = 12
WORKERS = 2
STEPS = 3


def program() -> Program:
    return Program(odd_mlp(dtype=torch.float64), "momentum", lr=0.05, momentum=0.9)


def pserver_threads() -> int:
    """Threads the pservers of this process run: the handler pools (``pserver_N``), loops and watchers."""
    return sum(1 for t in threading.enumerate() if t.name.startswith("pserver"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("on_loop", [True, False], ids=["stretches-on-loop", "stretches-in-pool"])
def test_more_trainers_than_handler_threads_complete_every_step(on_loop):
    """Each step applies once and releases every parked push, its stretches on the event loop or in the
    pool."""
    data = batches(TRAINERS, 4, STEPS, dtype=torch.float64)
    config = DistributeTranspilerConfig(pserver_rpc_workers=WORKERS, pserver_stretches_on_loop=on_loop)
    before = pserver_threads()
    seen = []

    def body(tr, i):
        for step_batches in data:
            x, y = step_batches[i]
            torch.nn.functional.cross_entropy(tr.model(x), y).backward()
            tr.step()
            seen.append(pserver_threads())
        return tr.state_dict()

    with LocalCluster(program, 2, TRAINERS, config=config) as cluster:
        assert all(s.stretches.allowed is on_loop for s in cluster.servers)
        states = cluster.run_trainers(body, timeout=100)
        assert all(s.engine.step == STEPS for s in cluster.servers)
        assert all(s.engine.waits.parked == 0 for s in cluster.servers)  # every parked push was released
    expected = train_concatenated(program(), data)
    for i in range(TRAINERS):
        for name in expected:
            torch.testing.assert_close(states[i][name], expected[name], **FLOAT64_EXACT)
    assert not torch.allclose(expected["fc2.weight"], odd_mlp(dtype=torch.float64).state_dict()["fc2.weight"])
    # Per pserver: at most WORKERS pool threads, its event loop and its two watchers, whatever the trainers.
    assert len(seen) == TRAINERS * STEPS
    assert max(seen) - before <= 2 * (WORKERS + 3), seen


def full_grads(server, value=0.5):
    return [(n, torch.full(spec.shape, value)) for n, spec in server.engine.store.specs.items()]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["PushPull", "PushPullOne"])
@pytest.mark.parametrize("on_loop", [True, False], ids=["stretches-on-loop", "stretches-in-pool"])
def test_a_parked_push_whose_client_gives_up_leaves_no_handle(method, on_loop):
    """Trainer 1 never pushes: trainer 0's parked push ends at its client's deadline, and the pserver
    forgets it."""
    config = DistributeTranspilerConfig(pserver_rpc_workers=1, pserver_stretches_on_loop=on_loop)
    with LocalCluster(lambda: Program(odd_mlp(), "sgd", lr=0.1), 1, 2, config=config) as cluster:
        server = cluster.servers[0]
        digest = server.program.layout_digest
        with grpc.insecure_channel(cluster.endpoints[0]) as channel:
            stub = ps_pb2_grpc.ParameterServerStub(channel)
            sessions = open_sessions(stub, digest)
            messages = list(push_messages(digest, 0, 0, full_grads(server), sessions=sessions))
            with pytest.raises(grpc.RpcError) as refused:
                if method == "PushPull":
                    list(stub.PushPull(iter(messages), timeout=1.0))
                else:
                    header = ps_pb2.PushHeader(
                        trainer_id=0, step=0, layout_digest=digest, session=sessions[0]
                    )
                    channel.unary_unary(f"/{SERVICE}/PushPullOne")(
                        one_message(header, full_grads(server)), timeout=1.0
                    )
            assert refused.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            poll(lambda: server.engine.waits.parked == 0, "the abandoned wait forgotten")
            # The push itself was counted: trainer 1's completes the step, and the one handler thread still
            # serves.
            reply = answer(
                stub.PushPull(push_messages(digest, 1, 0, full_grads(server), sessions=sessions), timeout=10)
            )
            assert reply.step == 1 and server.engine.step == 1
