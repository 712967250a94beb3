"""Stage c: a trainer node's path on the one GPU: NCCL as a group of one, its two-rank logic over gloo.

NCCL refuses two ranks on one device, so the node's code runs three ways, CUDA tensors throughout:

- ``nccl1``: the node's collectives (:class:`trainer.node.NodeGroup`: reduce-scatter of the
  gradients into pinned staging, all-gather of the parameters, a failed rank's status, the
  leader's broadcast, the merge of table gradients) over an NCCL group of one process;
- ``gloo2-scatter`` and ``gloo2-all_reduce``: the same with two processes on ``cuda:0`` over gloo,
  with each of NodeGroup's two exchanges (reduce-scatter + all-gather, what it picks for CUDA
  tensors; all-reduce, what it picks for CPU ones), every figure checked against the mean of
  both ranks' gradients;
- ``node-trainer``: a whole trainer node (two local ranks, ``Trainer(local_rank=r,
  local_world_size=2)``) against 2 pservers, sync, both ranks on ``cuda:0`` over a gloo group
  the processes make first (the Trainer then uses it): after the steps both equal one process on
  the concatenated batches (rtol 1e-4, atol 1e-5), and each pserver counted one push a step.
  The Trainer places local rank r on ``cuda:r``; with one GPU this stage places both on
  ``cuda:0`` by replacing ``trainer.pserver_trainer.pick_device`` in those two processes.

On the CPU (``--device cpu``) ``nccl1`` is a gloo group of one and every tensor is on the CPU.

    python -m benchmarks.gpu_check.node_stage --device cuda --result c.json
"""

from __future__ import annotations

import datetime
import sys
import time
from typing import Dict, List, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from benchmarks.gpu_check.worker import (
    ATOL,
    RTOL,
    Children,
    Outcome,
    compare_states,
    device_of,
    first_line,
    run_worker,
)
from harness.cluster import LocalCluster
from harness.models import batches, odd_mlp, train_concatenated
from harness.ports import free_ports
from transpiler import DistributeTranspiler, Program

FAKE_PSERVERS = "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"  # three: the two ranks own unequal shares
PER_RANK, STEPS = 12, 3
TIMEOUT = 90.0
GROUP_TIMEOUT = datetime.timedelta(seconds=60)


def node_program() -> Program:
    return Program(odd_mlp(dtype=torch.float32), "momentum", lr=0.05, momentum=0.9)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a.detach().cpu().double(), b.detach().cpu().double(), rtol=RTOL, atol=ATOL)


def exchange(
    backend: str, exchange_kind: str, rank: int, world: int, port: int, data, device_name: str
) -> dict:
    """One rank exercising NodeGroup directly (no pservers): {check: passed}, {check: error}, the gradient
    error.

    Each check runs on its own: one that raises (a collective the backend lacks for CUDA tensors) is
    recorded with its error and the next still runs, on every rank alike.
    """
    from trainer.blocks import LocalBlocks
    from trainer.node import OK, RECOVERABLE, Layout, NodeGroup

    device = device_of(device_name)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=GROUP_TIMEOUT
    )
    checks: Dict[str, bool] = {}
    errors: Dict[str, str] = {}

    def attempt(name: str, check) -> None:
        try:
            checks[name] = bool(check())
        except Exception as e:  # recorded; the other checks still run
            checks[name], errors[name] = False, first_line(e)

    try:
        t = DistributeTranspiler()
        t.transpile(0, program=Program(odd_mlp(), "sgd", lr=0.1), pservers=FAKE_PSERVERS, trainers=1)
        prog = t.get_trainer_program()
        every = []  # every rank's gradients, on the CPU: their mean is what the node must push
        for x, y in data[:world]:
            model = odd_mlp()
            nn.functional.cross_entropy(model(x), y).backward()
            every.append(LocalBlocks(prog, model))
        model = odd_mlp().to(device)
        blocks = LocalBlocks(prog, model)
        x, y = data[rank]
        nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
        group = NodeGroup(
            0,
            rank,
            Layout(blocks.by_endpoint, prog.pservers, world),
            device,
            dist.group.WORLD,
            exchange=exchange_kind,
        )
        names = sorted(blocks.by_name)
        share: List = []
        worst = [float("inf")]

        def reduce() -> bool:
            got, failed = group.reduce_grads(blocks.grad_rows, False)
            share.extend(got)
            mean = {n: sum(g.grad_rows(blocks.by_name[n]) for g in every) / world for n, _ in got}
            worst[0] = max((float((t.cpu() - mean[n]).abs().max()) for n, t in got), default=float("inf"))
            pinned = all(t.is_pinned() for _, t in got) if device.type == "cuda" else True
            return bool(got) and not failed and pinned and all(_close(t, mean[n]) for n, t in got)

        def gather() -> bool:  # block i comes back from the pservers as i + 0.5
            value = {n: float(i) + 0.5 for i, n in enumerate(names)}
            for n, _ in share:
                group.param_dest(n).fill_(value[n])
            return group.gather_params(OK, blocks.view) == OK and all(
                bool((blocks.view(blocks.by_name[n]) == value[n]).all()) for n in names
            )

        def failed_gather() -> bool:  # the last rank's pull failed: nobody installs anything
            before = {n: blocks.view(blocks.by_name[n]).clone() for n in names}
            for n, _ in share:
                group.param_dest(n).fill_(-7.0)
            status = RECOVERABLE if rank == world - 1 else OK
            return group.gather_params(status, blocks.view) == RECOVERABLE and all(
                torch.equal(blocks.view(blocks.by_name[n]), before[n]) for n in names
            )

        def broadcast() -> bool:
            if rank == 0:
                with torch.no_grad():
                    for n in names:
                        blocks.view(blocks.by_name[n]).fill_(1.25)
            group.broadcast_params(blocks.view)
            return all(bool((blocks.view(blocks.by_name[n]) == 1.25).all()) for n in names)

        def tables() -> bool:  # rank r saw ids [1, 2 + r] with rows r + 1; the node merges and averages
            local = {"emb": (np.array([1, 2 + rank], dtype=np.int64), torch.full((2, 4), float(rank + 1)))}
            ids, rows = group.merge_table_grads(local, {"emb": (4, torch.float32)})["emb"]
            expected: Dict[int, float] = {}
            for r in range(world):
                for i in (1, 2 + r):
                    expected[i] = expected.get(i, 0.0) + (r + 1) / world
            return sorted(ids.tolist()) == sorted(expected) and all(
                bool((rows[k] == expected[int(i)]).all()) for k, i in enumerate(ids.tolist())
            )

        for name, check in (
            ("reduce", reduce),
            ("gather", gather),
            ("failed_gather", failed_gather),
            ("broadcast", broadcast),
            ("tables", tables),
        ):
            attempt(name, check)
        group.barrier("the end of the check")
        return {
            "checks": checks,
            "errors": errors,
            "max_abs_diff": worst[0],
            "device": str(device),
            "backend": dist.get_backend(),
        }
    finally:
        dist.destroy_process_group()


def _one_gpu_for_every_local_rank(device: torch.device) -> None:
    """Make this process's Trainer compute on ``device`` whatever its local rank (one GPU, two ranks)."""
    import trainer.pserver_trainer

    trainer.pserver_trainer.pick_device = lambda local_rank: device


def node_rank(endpoints: List[str], rank: int, port: int, data, device_name: str) -> dict:
    """Local rank ``rank`` of trainer node 0 (two local ranks over gloo on one device): train, keep the
    model."""
    from psproto.security import Security
    from trainer import Trainer

    device = device_of(device_name)
    _one_gpu_for_every_local_rank(device)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=GROUP_TIMEOUT
    )
    try:
        t = DistributeTranspiler()
        t.transpile(0, program=node_program(), pservers=",".join(endpoints), trainers=1, sync_mode=True)
        with Trainer(t.get_trainer_program(), security=Security(), local_rank=rank, local_world_size=2) as tr:
            for x, y in data:
                nn.functional.cross_entropy(tr.model(x.to(tr.device)), y.to(tr.device)).backward()
                tr.step()
            state = {k: v.detach().cpu() for k, v in tr.state_dict().items()}
            stepper = type(tr.stepper).__name__
        return {"state": state, "device": str(tr.device), "stepper": stepper, "backend": dist.get_backend()}
    finally:
        dist.destroy_process_group()


def start_exchange(children: Children, backend: str, kind: str, world: int, data, device: str) -> List[int]:
    """Start the ``world`` ranks of one exchange part; their indices for :func:`exchange_result`."""
    port = free_ports(1)[0]
    return [
        children.start(
            f"{backend} rank {r} ({kind})", exchange, (backend, kind, r, world, port, data, device)
        )
        for r in range(world)
    ]


def exchange_result(children: Children, started: List[int]) -> dict:
    results = children.wait(started, TIMEOUT)
    errors = {k: v for r in results for k, v in r["errors"].items()}
    return {
        "ok": all(all(r["checks"].values()) for r in results),
        "failed": sorted({k for r in results for k, v in r["checks"].items() if not v}),
        "errors": errors,
        "max_abs_diff": max(r["max_abs_diff"] for r in results),
        "backend": results[0]["backend"],
    }


def run_node(children: Children, data, device: torch.device) -> dict:
    ranks = [[step[r] for step in data] for r in range(2)]
    port = free_ports(1)[0]
    with LocalCluster(node_program, 2, 1) as cluster:
        started = [
            children.start(f"node rank {r}", node_rank, (cluster.endpoints, r, port, ranks[r], device.type))
            for r in range(2)
        ]
        results = children.wait(started, TIMEOUT)
        pushes = [dict(s.servicer.counters.pushes_by_trainer) for s in cluster.servers]
    prog = node_program()
    prog.model.to(device)
    expected = train_concatenated(prog, [[(x.to(device), y.to(device)) for x, y in step] for step in data])
    compared = [compare_states(r["state"], expected) for r in results]
    failed = [
        what
        for what, ok in (
            ("state", all(ok for ok, _, _ in compared)),
            ("pushes", pushes == [{0: STEPS}] * 2),
            ("device", all(r["device"] == str(device) for r in results)),
        )
        if not ok
    ]
    return {
        "ok": not failed,
        "failed": failed,
        "max_abs_diff": max(d for _, d, _ in compared),
        "pushes": pushes,
        "stepper": results[0]["stepper"],
        "backend": results[0]["backend"],
        "devices": sorted({r["device"] for r in results}),
    }


def run(args) -> Outcome:
    device = device_of(args.device)
    data = batches(2, PER_RANK, STEPS)
    one = backend_of_one(args.device)
    parts: Dict[str, dict] = {}
    t0 = time.monotonic()
    with Children("the node path") as children:
        # The three exchange parts run side by side (each its own group and port), the node meanwhile.
        started = {
            f"{one}1": start_exchange(children, one, "scatter", 1, data[0], args.device),
            "gloo2-scatter": start_exchange(children, "gloo", "scatter", 2, data[0], args.device),
            "gloo2-all_reduce": start_exchange(children, "gloo", "all_reduce", 2, data[0], args.device),
        }
        calls = [("node-trainer", lambda: run_node(children, data, device))]
        calls += [(name, lambda ids=ids: exchange_result(children, ids)) for name, ids in started.items()]
        for name, call in calls:
            try:
                parts[name] = call()
            except Exception as e:  # one part failing does not hide the others'
                parts[name] = {"ok": False, "failed": [], "error": first_line(e)}
    order = [f"{one}1", "gloo2-scatter", "gloo2-all_reduce", "node-trainer"]
    figures: Dict[str, object] = {name: "ok" if parts[name]["ok"] else "FAIL" for name in order}
    diffs = [p["max_abs_diff"] for p in parts.values() if "max_abs_diff" in p]
    figures["max_abs_diff"] = max(diffs) if diffs else float("nan")
    if "pushes" in parts["node-trainer"]:
        figures["node_pushes_per_pserver"] = [sum(p.values()) for p in parts["node-trainer"]["pushes"]]
    figures["seconds_all"] = round(time.monotonic() - t0, 1)
    notes = []
    for name in order:
        p = parts[name]
        if not p["ok"]:
            why = p.get("error") or ", ".join(
                f"{k} ({p.get('errors', {}).get(k, 'wrong values')})" for k in p["failed"]
            )
            notes.append(f"{name}: {why}")
    return not notes, figures, "; ".join(notes)


def backend_of_one(device: str) -> str:
    """The backend of the group of one: NCCL on the GPU (what a node uses there), gloo on the CPU."""
    return "nccl" if device == "cuda" else "gloo"


def plan(device: str, quick: bool) -> Dict[str, object]:
    """What the stage runs; checks the names it reaches into are there (nothing starts)."""
    import trainer.pserver_trainer
    from trainer.node import NodeGroup

    for name in ("reduce_grads", "gather_params", "broadcast_params", "merge_table_grads", "param_dest"):
        if not hasattr(NodeGroup, name):
            raise AttributeError(f"trainer.node.NodeGroup has no {name}: the node stage needs updating")
    if not callable(getattr(trainer.pserver_trainer, "pick_device", None)):
        raise AttributeError(
            "trainer.pserver_trainer.pick_device is gone: the node-trainer part needs updating"
        )
    parts: Sequence[str] = (f"{backend_of_one(device)}1", "gloo2-scatter", "gloo2-all_reduce", "node-trainer")
    return {
        "parts": list(parts),
        "device": f"{device}:0 for every rank" if device == "cuda" else "cpu",
        "node": "2 local ranks, 2 pservers, sync",
        "steps": STEPS,
        "tolerance": "rtol 1e-4, atol 1e-5",
    }


def main(argv=None) -> int:
    return run_worker(argv, __doc__, run, plan)


if __name__ == "__main__":
    sys.exit(main())
