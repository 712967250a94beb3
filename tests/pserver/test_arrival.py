"""A trainer's call is a sign of life on arrival (pserver/rpc/arrival.py), even while it queues for a thread."""
from __future__ import annotations

import threading

import pytest
import torch

from psproto.wire import TRAINER_METADATA
from pserver.rpc.arrival import trainer_of
from tests.helpers.cluster import LocalCluster
from tests.helpers.models import odd_mlp
from tests.helpers.polling import poll
from transpiler import DistributeTranspilerConfig, Program


@pytest.mark.parametrize("metadata, trainers, expected", [
    ((), 4, None),                                              # no metadata: a call of no trainer (ps-stat)
    (None, 4, None),
    ((("authorization", "Bearer x"),), 4, None),
    (((TRAINER_METADATA, "2"),), 4, 2),
    ((("authorization", "Bearer x"), (TRAINER_METADATA, "0")), 4, 0),
    (((TRAINER_METADATA, "4"),), 4, None),                      # out of the job's range: ignored
    (((TRAINER_METADATA, "-1"),), 4, None),
    (((TRAINER_METADATA, "one"),), 4, None),                    # not a number: ignored
    (((TRAINER_METADATA, ""),), 4, None),
])
def test_trainer_of(metadata, trainers, expected):
    assert trainer_of(metadata, trainers) == expected


def program() -> Program:
    return Program(odd_mlp(dtype=torch.float64), "sgd", lr=0.1)


@pytest.mark.timeout(60)
def test_a_call_queued_behind_a_busy_pool_is_noted_on_arrival():
    config = DistributeTranspilerConfig(pserver_rpc_workers=1)
    with LocalCluster(program, 1, 2, config=config) as cluster:
        server, endpoint = cluster.servers[0], cluster.endpoints[0]
        with cluster.trainer(1) as tr:
            heard = server.engine.presence(1)[0]
            gate, busy = threading.Event(), threading.Event()
            server._pool.submit(lambda: (busy.set(), gate.wait(30)))  # the pool's one thread, held
            assert busy.wait(10)
            try:
                done = {}
                call = threading.Thread(target=lambda: done.setdefault(
                    "reply", tr.channels[endpoint].heartbeat(timeout=30)))
                call.start()
                # The heartbeat cannot run (no free thread), yet the pserver heard from trainer 1 as it arrived.
                poll(lambda: server.engine.presence(1)[0] > heard, "trainer 1 noted on arrival", timeout=20)
                assert "reply" not in done
            finally:
                gate.set()
            call.join(30)
            assert done["reply"].incarnation == server.servicer.incarnation
