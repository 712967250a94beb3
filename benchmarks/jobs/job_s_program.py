"""Job S's program and data: the model (:class:`CtrNet`), its transpiler program, and the batches of
``jobs.ctr_batch`` as a trainer and a pserver shard see them.

``job_s.py`` runs the job (a role per process); the benchmarks that build job S's pserver without running
the job (``bench_push``, ``bench_table_push``, ``bench_dense_apply``, the fan-in emulation, the GPU check)
take the program and data from here.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from transpiler import Program, TableOptions
from transpiler.tables import shard_of

# Capacity hint only: ids are any int64 (slot << 40 | z) and live on the pservers.
CAPACITY = 26_000_000
TABLE = "emb"


class CtrNet(nn.Module):
    """Job S's model: one shared dim-16 table over 26 slots, concatenated with 13 dense features, MLP
    429-256-128-1.

    The table is built on the meta device (its rows live on the pservers); the MLP is seeded, so every role
    builds the same initial weights.
    """

    def __init__(self, jobs, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(CAPACITY, jobs.S_EMB_DIM, sparse=True, device="meta")
        h1, h2 = jobs.S_HIDDEN
        self.mlp = nn.Sequential(
            nn.Linear(jobs.S_SLOTS * jobs.S_EMB_DIM + jobs.S_DENSE, h1),
            nn.ReLU(),
            nn.Linear(h1, h2),
            nn.ReLU(),
            nn.Linear(h2, 1),
        )

    def forward(self, ids: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        e = self.emb(ids).reshape(ids.shape[0], -1)
        return self.mlp(torch.cat([e, dense], dim=1)).squeeze(1)


def build_program(jobs, seed: int = 0, ram_rows: int = 0) -> Program:
    """Dense MLP with SGD lr 0.05; the table distributed with SGD lr 0.05 and N(0, 0.01^2) initial rows.

    ``ram_rows``: the table keeps that many rows in memory and the rest in its disk tier (0: all in memory).
    """
    table = TableOptions(
        optimizer="sgd",
        optimizer_kwargs={"lr": jobs.S_LR},
        init="normal",
        init_kwargs={"std": 0.01},
        lifecycle={"ram_rows": ram_rows} if ram_rows else None,
    )
    return Program(CtrNet(jobs, seed), "sgd", lr=jobs.S_LR, distributed_tables={TABLE: table})


def make_batches(jobs, trainer_id: int, trainers: int, steps: int, batch: int, seed: int):
    """This trainer's ``steps`` batches as tensors: step ``t`` is ``ctr_batch(t * trainers + trainer_id)``."""
    out = []
    for t in range(steps):
        ids, dense, y = jobs.ctr_batch(t * trainers + trainer_id, batch=batch, seed=seed, stream=0)
        out.append((torch.from_numpy(ids), torch.from_numpy(dense), torch.from_numpy(y)))
    return out


def shard_batch_ids(jobs, index: int, n_shards: int, shard: int = 0, batch: int = 512) -> np.ndarray:
    """The distinct ids of ``jobs.ctr_batch(index)`` on table shard ``shard`` of ``n_shards``: what a push of
    that batch to the shard's pserver carries gradients of (or, for the next batch, asks rows of)."""
    ids = np.unique(jobs.ctr_batch(index, batch=batch)[0])
    return ids[shard_of(ids, n_shards) == shard]
