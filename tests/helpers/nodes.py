"""Trainer nodes of several local processes for tests: pservers in the test process, local ranks spawned.

Every local process is a real process (torch.distributed allows one process
group per process); the pservers are the in-process ones of
:class:`~tests.helpers.cluster.LocalCluster`.
"""
from __future__ import annotations

import multiprocessing
import os
import time
from typing import Callable, List, Optional, Sequence

import torch
from torch import nn

from .ports import free_ports

PROCESS_TIMEOUT = 90.0


def node_process(build: Callable, endpoints: Sequence[str], node_id: int, local_rank: int, local_world_size: int,
                 nodes: int, port: int, data, out: str, config=None, tables: Sequence[str] = ()) -> None:
    """One local process: train one step per item of ``data`` on its own batch, save what it ends with.

    ``data[step][node_id * local_world_size + local_rank]`` is its batch:
    (x, y) for a dense model, (ids, bag_ids, y) for the table model.
    """
    from psproto.security import Security
    from trainer import Trainer
    from transpiler import DistributeTranspiler, DistributeTranspilerConfig

    torch.set_num_threads(1)
    t = DistributeTranspiler(config or DistributeTranspilerConfig())
    t.transpile(node_id, program=build(), pservers=",".join(endpoints), trainers=nodes, sync_mode=True)
    with Trainer(t.get_trainer_program(), security=Security(), local_rank=local_rank,
                 local_world_size=local_world_size, init_method=f"tcp://127.0.0.1:{port}") as tr:
        me = node_id * local_world_size + local_rank
        for step_batches in data:
            *inputs, y = step_batches[me]
            nn.functional.cross_entropy(tr.model(*inputs), y).backward()
            tr.step()
        rows = {name: tr.pull_rows(name, torch.from_numpy(vocab)) for name, vocab in tables}
        torch.save((tr.state_dict(), rows, tr.step_count), out)


def run_nodes(tmp_path, build: Callable, endpoints: Sequence[str], data, nodes: int = 2,
              local_world_size: int = 2, config=None, tables: Sequence = ()) -> List[tuple]:
    """Start ``nodes`` x ``local_world_size`` local processes, wait for all; (state, rows, steps) of each."""
    ctx = multiprocessing.get_context("spawn")
    ports = free_ports(nodes)
    procs, outs = [], []
    for n in range(nodes):
        for r in range(local_world_size):
            out = os.path.join(str(tmp_path), f"node{n}-rank{r}.pt")
            outs.append(out)
            procs.append(ctx.Process(target=node_process, args=(build, endpoints, n, r, local_world_size, nodes,
                                                                ports[n], data, out, config, tables)))
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + PROCESS_TIMEOUT
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
        codes = [p.exitcode for p in procs]
        assert codes == [0] * len(procs), f"local processes exited with {codes}"
    finally:
        stop(procs)
    return [torch.load(out, weights_only=False) for out in outs]


def stop(procs: Sequence, grace: Optional[float] = 5.0) -> None:
    """Kill whatever of ``procs`` still runs, and reap it."""
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(grace)
