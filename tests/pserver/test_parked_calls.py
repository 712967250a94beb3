"""A sync job with more trainers than handler threads: parked pushes hold no thread, so it completes.

Under the threaded server each trainer's PushPull held a handler thread until
its step applied; 12 trainers on 2 threads deadlocked the step. On the asyncio
server (pserver/rpc/aio.py) a parked push holds none: the steps complete, the
model equals single-process training on the concatenated batch (the mean of
the trainers' gradients), and the pserver's threads stay within the pool's bound.
"""
import threading

import pytest
import torch

from tests.helpers.cluster import LocalCluster
from tests.helpers.models import FLOAT64_EXACT, batches, odd_mlp, train_concatenated
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
def test_more_trainers_than_handler_threads_complete_every_step():
    data = batches(TRAINERS, 4, STEPS, dtype=torch.float64)
    config = DistributeTranspilerConfig(pserver_rpc_workers=WORKERS)
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
        states = cluster.run_trainers(body, timeout=100)
        assert all(s.engine.updates == STEPS for s in cluster.servers)
        assert all(s.engine.waits.parked == 0 for s in cluster.servers)  # every parked push was released
    expected = train_concatenated(program(), data)
    for i in range(TRAINERS):
        for name in expected:
            torch.testing.assert_close(states[i][name], expected[name], **FLOAT64_EXACT)
    assert not torch.allclose(expected["fc2.weight"], odd_mlp(dtype=torch.float64).state_dict()["fc2.weight"])
    # Per pserver: at most WORKERS pool threads, its event loop and its two watchers, whatever the trainers.
    assert len(seen) == TRAINERS * STEPS
    assert max(seen) - before <= 2 * (WORKERS + 3), seen
