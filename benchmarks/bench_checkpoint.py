"""Checkpoint cost of one pserver against torch.save / torch.load of the same state in one process.

Usage::

    python -m benchmarks.bench_checkpoint [--runs 5] [--rows 2000000] [--dim 16] [--dir DIR]

One pserver (in this process, no trainers) holds every block of the dense MLP
of ``bench_dense.py`` (38 MB) with Adam state, and one distributed table of
``--rows`` stored rows of ``--dim`` with Adagrad state. Timed, alternating
round by round, medians of ``--runs``:

- write: ``Checkpointer.save`` (blocks, optimizer state, table shard, manifest;
  every file fsynced, renamed, manifest last): a sync job's pause at a
  checkpoint step, as the write runs under the engine lock;
- load: ``Checkpointer.load`` into a fresh pserver's state (what a restarted
  pserver does before it serves);
- peer: ``torch.save`` of the single-process equivalent (model state_dict,
  optimizer state_dict, the table's weight and Adagrad sum as dense tensors)
  to one file with fsync, and ``torch.load`` of it.

``--dir`` should be on the disk a job would use (default: a temp dir).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
from torch import nn

from benchmarks.jobs.dense_workers import build_model
from pserver.checkpoint.checkpointer import Checkpointer
from pserver.store import BlockStore
from pserver.tables.table_set import TableSet
from transpiler import DistributeTranspiler, DistributeTranspilerConfig, Program, TableOptions

ENDPOINT = "127.0.0.1:1"


class Model(nn.Module):
    def __init__(self, rows: int, dim: int):
        super().__init__()
        self.mlp = build_model((512, 2048, 2048, 2048, 10), seed=0)
        self.emb = nn.Embedding(rows, dim, sparse=True, device="meta")


def pserver_state(rows: int, dim: int):
    """(store, tables) of one pserver holding the whole model, optimizer state filled."""
    prog = Program(
        Model(rows, dim), "adam", lr=1e-3, distributed_tables={"emb": TableOptions(optimizer="adagrad")}
    )
    t = DistributeTranspiler(DistributeTranspilerConfig(slice_var_up=False))
    t.transpile(0, program=prog, pservers=ENDPOINT, trainers=1, sync_mode=True)
    ps = t.get_pserver_program(ENDPOINT)
    store, tables = BlockStore(ps, t.get_startup_program(ENDPOINT, ps)), TableSet(ps)
    store.apply({n: torch.randn_like(b) for n, b in store.blocks.items()}, 0)  # Adam state exists
    shard = tables.shards["emb"]
    ids = np.arange(rows, dtype=np.int64)
    for a in range(0, rows, 500_000):
        part = ids[a : a + 500_000]
        shard.apply(part, torch.randn(len(part), dim), 0.01)
    return ps, store, tables


def torch_peer_state(store, rows: int, dim: int) -> dict:
    model = build_model((512, 2048, 2048, 2048, 10), seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "emb.weight": torch.randn(rows, dim),
        "emb.sum": torch.rand(rows, dim),
    }


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5, help="alternating runs of each (default %(default)s)")
    p.add_argument(
        "--rows", type=int, default=2_000_000, help="stored rows of the table (default %(default)s)"
    )
    p.add_argument("--dim", type=int, default=16, help="the table's row width (default %(default)s)")
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    root = tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir)
    try:
        ps, store, tables = pserver_state(args.rows, args.dim)
        peer = torch_peer_state(store, args.rows, args.dim)
        ck = Checkpointer(os.path.join(root, "ckpt"), store, tables, 0, 1, ENDPOINT, True, keep=2)
        peer_path = os.path.join(root, "peer.pt")

        def peer_save():
            with open(peer_path, "wb") as f:
                torch.save(peer, f)
                f.flush()
                os.fsync(f.fileno())

        _, fresh_store, fresh_tables = ps, BlockStore(ps, None), TableSet(ps)
        loader = Checkpointer(os.path.join(root, "ckpt"), fresh_store, fresh_tables, 0, 1, ENDPOINT, True)
        results = {k: [] for k in ("write", "load", "peer write", "peer load")}
        for run in range(args.runs):
            results["write"].append(timed(lambda: ck.save(run + 1, {"trainers": {}, "closed": []})))
            results["peer write"].append(timed(peer_save))
            results["load"].append(timed(lambda: loader.load()))
            results["peer load"].append(timed(lambda: torch.load(peer_path, weights_only=True)))
        part = ck.last.path
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(part) for f in fs)
        assert torch.equal(fresh_store.blocks["mlp.0.weight.block0"], store.blocks["mlp.0.weight.block0"])
        assert len(fresh_tables.shards["emb"]) == args.rows
        print(
            f"state: dense {store.nbytes / 1e6:.1f} MB + Adam state; table {args.rows:,} rows x {args.dim} "
            f"+ Adagrad state; checkpoint part {size / 1e6:.1f} MB, peer file "
            f"{os.path.getsize(peer_path) / 1e6:.1f} MB; {args.runs} runs, cores {os.cpu_count()}"
        )
        print(f"{'':12} {'median s':>9} {'min':>7} {'max':>7} {'MB/s':>7}")
        for name, times in results.items():
            mb = (os.path.getsize(peer_path) if name.startswith("peer") else size) / 1e6
            med = statistics.median(times)
            print(f"{name:12} {med:9.3f} {min(times):7.3f} {max(times):7.3f} {mb / med:7.0f}")
        # A restarted pserver loads once, into memory it never touched: the first load is its case.
        print(
            f"first load in this process: ours {results['load'][0]:.3f} s, "
            f"torch.load {results['peer load'][0]:.3f} s"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
