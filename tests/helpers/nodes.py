"""Trainer nodes of several local processes for tests: pservers in the test process, local ranks spawned.

Every local process is a real process (torch.distributed allows one process
group per process); the pservers are the in-process ones of
:class:`~harness.cluster.LocalCluster`.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import time
from typing import Callable, List, Optional, Sequence

import torch
from torch import nn

from harness.ports import free_ports

PROCESS_TIMEOUT = 90.0
# A spawned process with torch and dynamo loaded spends 1.2-1.4 s of its exit in the interpreter's last
# collection over their ~300k objects, which the tests wait for (joining it): 0.25 s once gc.freeze() has
# set them aside. Each process here calls it when its work is done and its files written.


def node_process(
    build: Callable,
    endpoints: Sequence[str],
    node_id: int,
    local_rank: int,
    local_world_size: int,
    nodes: int,
    port: int,
    data,
    out: str,
    config=None,
    tables: Sequence[str] = (),
    kill_at: Optional[int] = None,
) -> None:
    """One local process: train one step per item of ``data`` on its own batch, save what it ends with.

    ``data[step][node_id * local_world_size + local_rank]`` is its batch:
    (x, y) for a dense model, (ids, bag_ids, y) for the table model. The
    batches come through ``Trainer.batches``, so a restarted node goes on
    from its data position. ``kill_at``: SIGKILL itself before that batch's
    step, after writing ``out + ".killed"`` (the time). A failure writes
    ``out + ".error"`` (the time and the error) and exits non-zero.
    """
    from psproto.security import Security
    from trainer import Trainer
    from transpiler import DistributeTranspiler, DistributeTranspilerConfig

    torch.set_num_threads(1)
    t = DistributeTranspiler(config or DistributeTranspilerConfig())
    t.transpile(node_id, program=build(), pservers=",".join(endpoints), trainers=nodes, sync_mode=True)
    me = node_id * local_world_size + local_rank
    mine = [step_batches[me] for step_batches in data]
    try:
        with Trainer(
            t.get_trainer_program(),
            security=Security(),
            local_rank=local_rank,
            local_world_size=local_world_size,
            init_method=f"tcp://127.0.0.1:{port}",
        ) as tr:
            for *inputs, y in tr.batches(mine, 1):
                nn.functional.cross_entropy(tr.model(*inputs), y).backward()
                if kill_at is not None and tr.step_count == kill_at:
                    with open(out + ".killed", "w") as f:
                        f.write(repr(time.time()))
                    os.kill(os.getpid(), signal.SIGKILL)
                tr.step()
            rows = {name: tr.pull_rows(name, torch.from_numpy(vocab)) for name, vocab in tables}
            torch.save((tr.state_dict(), rows, tr.step_count), out)
    except Exception as e:
        with open(out + ".error", "w") as f:
            f.write(f"{time.time()!r}\n{type(e).__name__}: {e}")
        raise
    finally:
        gc.freeze()  # PROCESS_TIMEOUT's note


def start_node(
    ctx,
    build: Callable,
    endpoints: Sequence[str],
    node_id: int,
    local_world_size: int,
    nodes: int,
    port: int,
    data,
    tmp_path,
    config=None,
    tables: Sequence = (),
    kill: Optional[tuple] = None,
    tag: str = "",
) -> List[tuple]:
    """Start the local processes of node ``node_id``; [(process, output path)]. ``kill``: (local rank,
    step)."""
    started = []
    for r in range(local_world_size):
        out = os.path.join(str(tmp_path), f"node{node_id}-rank{r}{tag}.pt")
        kill_at = kill[1] if kill is not None and kill[0] == r else None
        p = ctx.Process(
            target=node_process,
            args=(
                build,
                endpoints,
                node_id,
                r,
                local_world_size,
                nodes,
                port,
                data,
                out,
                config,
                tables,
                kill_at,
            ),
        )
        p.start()
        started.append((p, out))
    return started


def wait_all(procs: Sequence, timeout: float = PROCESS_TIMEOUT) -> List[Optional[int]]:
    """Wait for ``procs`` within ``timeout`` s in all; their exit codes (None: still running)."""
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    return [p.exitcode for p in procs]


def run_nodes(
    tmp_path,
    build: Callable,
    endpoints: Sequence[str],
    data,
    nodes: int = 2,
    local_world_size: int = 2,
    config=None,
    tables: Sequence = (),
) -> List[tuple]:
    """Start ``nodes`` x ``local_world_size`` local processes, wait for all; (state, rows, steps) of each."""
    ctx = multiprocessing.get_context("spawn")
    ports = free_ports(nodes)
    started = [
        s
        for n in range(nodes)
        for s in start_node(
            ctx, build, endpoints, n, local_world_size, nodes, ports[n], data, tmp_path, config, tables
        )
    ]
    procs = [p for p, _ in started]
    try:
        codes = wait_all(procs)
        assert codes == [0] * len(procs), f"local processes exited with {codes}"
    finally:
        stop(procs)
    return [torch.load(out, weights_only=False) for _, out in started]


def stop(procs: Sequence, grace: Optional[float] = 5.0) -> None:
    """Kill whatever of ``procs`` still runs, and reap it."""
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(grace)


def exchange_process(exchange: str, rank: int, port: int, data, out: str) -> None:
    """One of 2 local ranks exercising NodeGroup's collectives directly (no pservers), with ``exchange``.

    Saves {"share": this rank's reduced blocks, "expected": the mean of both
    ranks' gradients of them, "installed": every block after a gather in
    which block i came back as i + 0.5, "failed_gather": the worst status of
    a gather where rank 1 failed, "after_failed": every block after it}.
    """
    import datetime

    import torch.distributed as dist

    from harness.models import odd_mlp
    from trainer.blocks import LocalBlocks
    from trainer.node import RECOVERABLE, Layout, NodeGroup
    from transpiler import DistributeTranspiler, Program

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        t = DistributeTranspiler()
        t.transpile(
            0,
            program=Program(odd_mlp(), "sgd", lr=0.1),
            pservers="127.0.0.1:1,127.0.0.1:2,127.0.0.1:3",
            trainers=1,
        )
        prog = t.get_trainer_program()
        grads = []
        for r, (x, y) in enumerate(data):  # both ranks' gradients, to know the mean
            model = odd_mlp()
            nn.functional.cross_entropy(model(x), y).backward()
            grads.append(LocalBlocks(prog, model))
        model = odd_mlp()
        blocks = LocalBlocks(prog, model)
        x, y = data[rank]
        nn.functional.cross_entropy(model(x), y).backward()
        layout = Layout(blocks.by_endpoint, prog.pservers, 2)
        group = NodeGroup(0, rank, layout, torch.device("cpu"), dist.group.WORLD, exchange=exchange)
        share, failed = group.reduce_grads(blocks.grad_rows, False)
        expected = {
            n: (grads[0].grad_rows(blocks.by_name[n]) + grads[1].grad_rows(blocks.by_name[n])) / 2
            for n, _ in share
        }
        names = sorted(blocks.by_name)
        for name, _ in share:
            group.param_dest(name).fill_(names.index(name) + 0.5)
        worst = group.gather_params(0, blocks.view)
        installed = {n: blocks.view(blocks.by_name[n]).clone() for n in names}
        for name, _ in share:
            group.param_dest(name).fill_(-1.0)
        failed_worst = group.gather_params(RECOVERABLE if rank == 1 else 0, blocks.view)
        after = {n: blocks.view(blocks.by_name[n]).clone() for n in names}
        torch.save(
            {
                "share": {n: t.clone() for n, t in share},
                "expected": expected,
                "failed": failed,
                "worst": worst,
                "installed": installed,
                "failed_gather": failed_worst,
                "after_failed": after,
                "endpoints": group.endpoints,
            },
            out,
        )
        # Both ranks out of every collective before either tears gloo down: a rank destroying the
        # group while the other still finishes the last gather can abort it ("terminate called").
        dist.barrier()
    finally:
        dist.destroy_process_group()
        gc.freeze()  # PROCESS_TIMEOUT's note
