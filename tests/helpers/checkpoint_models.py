"""A model with sliced dense parameters and a distributed table, for the checkpoint tests."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from transpiler import DistributeTranspilerConfig, Program

IDS = np.unique(np.random.default_rng(4).integers(-(2**50), 2**50, size=50, dtype=np.int64))


class Ranker(nn.Module):
    """A 64x512 layer (32k elements: one block per pserver on up to 4) and an embedding table."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 8, sparse=True)
        self.body = nn.Linear(64, 512)
        self.head = nn.Linear(512 + 8, 1)

    def forward(self, x, ids):
        return self.head(torch.cat([torch.tanh(self.body(x)), self.emb(ids)], 1)).squeeze(1)


def program(optimizer: str = "adam") -> Program:
    torch.manual_seed(5)
    return Program(Ranker(), optimizer, lr=0.01, distributed_tables=["emb"])


def config(checkpoint_dir: str, **kwargs) -> DistributeTranspilerConfig:
    return DistributeTranspilerConfig(checkpoint_dir=checkpoint_dir, barrier_timeout=30.0, **kwargs)


def batches(steps: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    return [
        (
            torch.randn(8, 64, generator=g),
            torch.from_numpy(IDS[rng.integers(0, len(IDS), 8)]),
            torch.randn(8, generator=g),
        )
        for _ in range(steps)
    ]


def train(tr, data) -> None:
    for x, ids, y in data:
        nn.functional.mse_loss(tr.model(x, ids), y).backward()
        tr.step()


def snapshot(tr) -> dict:
    """Dense parameters and the table's rows of every id the data uses."""
    state = {k: v for k, v in tr.state_dict().items() if not k.startswith("emb.")}
    state["emb@rows"] = tr.pull_rows("emb", torch.from_numpy(IDS))
    return state
