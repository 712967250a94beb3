"""A parameter far above any gRPC message limit goes through push and pull intact."""

import pytest
import torch
from torch import nn

from harness.cluster import LocalCluster
from transpiler import DistributeTranspilerConfig, Program

ROWS, COLS = 127_000, 1024  # 520 MB of float32 in one block (slicing off)


class Big(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(ROWS, COLS))


@pytest.mark.timeout(120)
def test_520_mb_parameter_round_trips():
    config = DistributeTranspilerConfig(slice_var_up=False)
    with LocalCluster(lambda: Program(Big(), "sgd", lr=1.0), 1, 1, config=config) as cluster:

        def body(tr, i):
            # grad[r, c] = -(r % 1000) so that w becomes r % 1000 after one step of SGD lr=1
            rows = (torch.arange(ROWS, dtype=torch.float32) % 1000).unsqueeze(1)
            tr.model.w.grad = (-rows).expand(ROWS, COLS).contiguous()
            tr.step()
            w = tr.model.w.detach()
            return bool(torch.equal(w[:, 0], rows[:, 0])) and bool(torch.equal(w[:, -1], rows[:, 0])), float(
                w.sum()
            )

        ((ok, total),) = cluster.run_trainers(body, timeout=100).values()
    assert ok
    assert total == pytest.approx(COLS * sum((r % 1000) for r in range(ROWS)), rel=1e-6)


class SmallAndBig(nn.Module):
    """A small parameter beside one whose block alone is more than one message holds (4 MiB)."""

    def __init__(self):
        super().__init__()
        self.small = nn.Parameter(torch.zeros(4, 4))
        self.big = nn.Parameter(torch.zeros(1200, 1000))  # 4.8 MB of float32


@pytest.mark.timeout(60)
def test_a_small_push_with_an_answer_beyond_one_message_streams_and_pushpullone_refuses_it_uncounted():
    """The trainer sends a push one message would carry by PushPullOne only when its answer fits one
    message too; else it streams (PushPull). PushPullOne refuses a push whose answer would not fit, before
    it counts."""
    import grpc

    from psproto import ps_pb2, ps_pb2_grpc
    from psproto.codec import encode_chunks

    config = DistributeTranspilerConfig(slice_var_up=False)
    with LocalCluster(lambda: Program(SmallAndBig(), "sgd", lr=1.0), 1, 1, config=config) as cluster:

        def body(tr, i):
            tr.model.small.grad = torch.full((4, 4), -2.0)  # only the small parameter has a gradient
            tr.step()
            return tr.model.small.detach().clone(), tr.model.big.detach().clone()

        ((small, big),) = cluster.run_trainers(body, timeout=50).values()
        assert torch.equal(small, torch.full((4, 4), 2.0)) and torch.equal(big, torch.zeros(1200, 1000))
        engine = cluster.servers[0].engine
        assert engine.step == 1

        digest = cluster.servers[0].program.layout_digest
        with grpc.insecure_channel(cluster.endpoints[0]) as channel:
            stub = ps_pb2_grpc.ParameterServerStub(channel)
            session = stub.Hello(
                ps_pb2.HelloRequest(trainer_id=0, layout_digest=digest, incarnation=7), timeout=10
            ).session
            header = ps_pb2.PushHeader(trainer_id=0, step=1, layout_digest=digest, session=session)
            small_block = next(
                n for n in cluster.servers[0].servicer.contents.block_names() if n.startswith("small")
            )
            (message,) = encode_chunks(header, [(small_block, torch.full((4, 4), -1.0))], 1 << 30)
            with pytest.raises(grpc.RpcError) as refused:
                channel.unary_unary("/psproto.ParameterServer/PushPullOne")(message, timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "more than one message holds" in refused.value.details()
        assert engine.step == 1 and engine.last_step.get(0, -1) == 0  # step 1 was not counted
