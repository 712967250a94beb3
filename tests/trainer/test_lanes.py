"""A push-pull split across lanes (``push_lanes``): the decision, the split, cancelling, and training equal
to one process through it (sync, two trainers; async, one), over real gRPC connections."""

import threading

import pytest
import torch
from torch import nn

from harness.cluster import LocalCluster
from harness.models import FLOAT64_EXACT, train_concatenated
from trainer.transport.lanes import Lanes, deal_lanes
from trainer.transport.wire_paths import ONE_MESSAGE, SHARED_MEMORY, STREAM
from transpiler import DistributeTranspilerConfig, Program

MiB = 1 << 20


def lanes(count: int, blocks=None) -> Lanes:
    return Lanes(count, blocks or {"w.block0": 8, "w.block1": 8}, MiB, connect=lambda: None)


@pytest.mark.parametrize(
    "count,way,nbytes,split",
    [
        (1, STREAM, 64 * MiB, False),  # one lane: never
        (2, STREAM, 2 * MiB, True),  # at least a chunk per lane
        (2, STREAM, 2 * MiB - 1, False),
        (4, STREAM, 3 * MiB, False),
        (2, ONE_MESSAGE, 4 * MiB, False),  # small calls go as one message
        (2, SHARED_MEMORY, 64 * MiB, False),  # same host: no socket to split
    ],
)
def test_which_push_pulls_are_split(count, way, nbytes, split):
    assert lanes(count).split(way, nbytes) is split


def test_split_push_deals_blocks_and_keeps_tables_in_lane_0():
    t = torch.zeros(1)
    tensors = [("w.block0", t), ("emb@ids", t), ("w.block1", t), ("emb@rows", t)]
    parts = deal_lanes(tensors, {"w.block0": 1, "w.block1": 0}, 2)
    assert [[n for n, _ in p] for p in parts] == [["emb@ids", "w.block1", "emb@rows"], ["w.block0"]]


class FakeCall:
    def __init__(self):
        self.cancelled = threading.Event()

    def cancel(self):
        self.cancelled.set()


def test_a_failed_lane_cancels_the_others_and_its_error_is_raised():
    calls = [FakeCall(), FakeCall()]

    def waits_for_cancel(k, started):
        started(calls[k])
        assert calls[k].cancelled.wait(10), "lane was never cancelled"
        raise RuntimeError(f"lane {k} cancelled")

    def fails(started):
        raise ConnectionError("lane 2 lost its connection")

    runner = lanes(3)
    with pytest.raises(ConnectionError, match="lane 2 lost"):
        runner.run([lambda s: waits_for_cancel(0, s), lambda s: waits_for_cancel(1, s), fails])
    runner.close()


def test_a_lane_that_starts_after_a_failure_is_cancelled_at_once():
    late = FakeCall()
    failed = threading.Event()

    def fails(started):
        failed.set()
        raise ConnectionError("lost")

    def starts_late(started):
        failed.wait(10)
        while not late.cancelled.is_set():
            started(late)  # the runner cancels what starts after a failure
        return 0

    runner = lanes(2)
    with pytest.raises(ConnectionError):
        runner.run([fails, starts_late])
    assert late.cancelled.is_set()
    runner.close()


def test_lanes_results_come_back_in_lane_order():
    runner = lanes(3)
    assert runner.run([lambda s, k=k: k * 10 for k in range(3)]) == [0, 10, 20]
    runner.close()


# -- training through lanes
# ---------------------------------------------------------------------------------------


def build() -> Program:
    # 1536 x 1024 float64: a push of about 6.3 MB to each of two pservers, so it streams and splits.
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 1024), nn.Tanh(), nn.Linear(1024, 1536), nn.Tanh(), nn.Linear(1536, 3)
    )
    return Program(model.double(), "adam", lr=0.01, weight_decay=0.01)


def data(trainers: int, steps: int = 3):
    g = torch.Generator().manual_seed(3)
    return [
        [
            (torch.randn(4, 16, generator=g, dtype=torch.float64), torch.randint(0, 3, (4,), generator=g))
            for _ in range(trainers)
        ]
        for _ in range(steps)
    ]


def train(cluster, batches):
    def body(tr, i):
        for step in batches:
            x, y = step[i]
            nn.functional.cross_entropy(tr.model(x), y).backward()
            tr.step()
        # Beside the channel's own: the gRPC lanes' connections, or the data channel's lanes.
        opened = [
            tr.channels[ep].lanes.opened or tr.channels[ep].data_connections - 1 for ep in tr.program.pservers
        ]
        return tr.state_dict(), opened

    return cluster.run_trainers(body)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("data_channel", [True, False])
@pytest.mark.parametrize("sync_mode,trainers", [(True, 2), (False, 1)])
def test_training_through_lanes_equals_one_process(sync_mode, trainers, data_channel):
    """Over the data channel (one connection per lane) and over gRPC (lanes of gRPC calls) alike."""
    batches = data(trainers)
    config = DistributeTranspilerConfig(push_lanes=3, shared_memory=False, data_channel=data_channel)
    with LocalCluster(build, 2, trainers, sync_mode=sync_mode, config=config) as cluster:
        results = train(cluster, batches)
        # Every pserver made each trainer's pushes whole from lanes, and counted each step once.
        for server in cluster.servers:
            assert server.servicer.data.lane_pushes.lane_of(3)
            assert len(server.servicer.data.lane_pushes._held) == trainers
            assert server.servicer.counters.pushes == trainers * len(batches)
    expected = train_concatenated(build(), batches)
    for state, opened in results.values():
        assert opened == [2, 2]  # two connections beside the channel's own, per pserver
        for name in expected:
            torch.testing.assert_close(
                state[name], expected[name], **FLOAT64_EXACT, msg=lambda m, n=name: f"{n}: {m}"
            )
    assert not torch.allclose(expected["2.weight"], build().model.state_dict()["2.weight"])
