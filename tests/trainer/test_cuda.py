"""The CUDA path of a trainer: device placement, pinned staging, NCCL pre-reduction in a node.

Runs only where CUDA is present (CI has none: the same logic runs on CPU with
gloo in tests/trainer/test_nodes.py). Numbers from a GPU run are in benchmarks/results/RESULTS.md.
"""

import datetime

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness.cluster import LocalCluster
from harness.models import batches, odd_mlp, train_concatenated
from harness.ports import free_ports
from psproto.security import Security
from trainer import Trainer
from trainer.node import Layout, NodeGroup
from transpiler import Program

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (this machine has no GPU)")


def program() -> Program:
    return Program(odd_mlp(dtype=torch.float32), "momentum", lr=0.05, momentum=0.9)


@pytest.mark.timeout(120)
def test_a_trainer_trains_on_its_local_rank_s_gpu_through_pinned_buffers():
    data = batches(1, 16, 3)
    with LocalCluster(program, 2, 1) as cluster:
        tr = Trainer(
            cluster.transpiler(0).get_trainer_program(), security=Security(), local_rank=0, local_world_size=1
        )
        with tr:
            assert tr.device == torch.device("cuda", 0)
            assert all(p.device == tr.device for p in tr.model.parameters())
            for ((x, y),) in data:
                nn.functional.cross_entropy(tr.model(x.to(tr.device)), y.to(tr.device)).backward()
                tr.step()
            pinned = list(tr.blocks._pinned_buffers.values())
            assert pinned and all(t.is_pinned() for t in pinned)  # pushes and pulls staged in pinned memory
            state = {k: v.cpu() for k, v in tr.state_dict().items()}
    expected = train_concatenated(program(), data)
    for k in expected:
        torch.testing.assert_close(state[k], expected[k], rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(60)
def test_the_node_s_collectives_run_on_nccl():
    """A one-process NCCL group through NodeGroup: reduce-scatter, pinned staging, all-gather."""
    model = odd_mlp().cuda()
    with LocalCluster(program, 2, 1) as cluster:
        prog = cluster.transpiler(0).get_trainer_program()
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{free_ports(1)[0]}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=30),
    )
    try:
        from trainer.blocks import LocalBlocks

        blocks = LocalBlocks(prog, model)
        layout = Layout(blocks.by_endpoint, prog.pservers, 1)
        group = NodeGroup(0, 0, layout, torch.device("cuda", 0), dist.group.WORLD)
        x = torch.randn(8, 37, device="cuda")
        model(x).sum().backward()
        share, failed = group.reduce_grads(blocks.grad_rows, False)
        assert not failed and share
        for name, t in share:
            assert t.is_pinned()
            torch.testing.assert_close(t, blocks.grad_rows(blocks.by_name[name]).cpu())
        for name, t in share:
            group.param_dest(name).fill_(0.25)
        assert group.gather_params(0, blocks.view) == 0
        assert all(bool((blocks.view(blocks.by_name[n]) == 0.25).all()) for n, _ in share)
    finally:
        dist.destroy_process_group()
