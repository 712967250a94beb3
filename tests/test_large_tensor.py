"""A parameter far above any gRPC message limit goes through push and pull intact."""
import pytest
import torch
from torch import nn

from tests.helpers.cluster import LocalCluster
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
            return bool(torch.equal(w[:, 0], rows[:, 0])) and bool(torch.equal(w[:, -1], rows[:, 0])), \
                float(w.sum())
        (ok, total), = cluster.run_trainers(body, timeout=100).values()
    assert ok
    assert total == pytest.approx(COLS * sum((r % 1000) for r in range(ROWS)), rel=1e-6)
