"""Stage b: pserver mode with two trainer processes on the one GPU against one GPU process.

Two trainer processes (each ``local_rank=0, local_world_size=1``: a trainer of its own, so both
take ``cuda:0``) train the CPU tests' odd-sized MLP with momentum SGD against 2 pservers on the
CPU, sync; their pushes and pulls stage through pinned host buffers. After the steps both must
hold what one GPU process reaches training on the two batches concatenated, within the CPU
tests' tolerance (rtol 1e-4, atol 1e-5), TF32 off everywhere.

    python -m benchmarks.gpu_check.pserver_stage --device cuda --result b.json
"""

from __future__ import annotations

import sys
import time
from typing import Dict, List

import torch
from torch import nn

from benchmarks.gpu_check.worker import (
    Children,
    Outcome,
    compare_states,
    device_of,
    finite,
    run_worker,
    tf32_off,
)
from harness.cluster import LocalCluster
from harness.models import batches, odd_mlp, train_concatenated
from transpiler import DistributeTranspiler, Program

TRAINERS, PSERVERS = 2, 2
PER_TRAINER, STEPS = 16, 4
TIMEOUT = 60.0  # the trainers' processes, start to end


def program() -> Program:
    """The CUDA tests' program: the odd-sized MLP, momentum SGD."""
    return Program(odd_mlp(dtype=torch.float32), "momentum", lr=0.05, momentum=0.9)


def train_trainer(endpoints: List[str], trainer_id: int, data, device_name: str) -> Dict[str, object]:
    """One trainer process: its batches on the device, a push and pull per step; what it ends with."""
    from psproto.security import Security
    from trainer import Trainer

    device = device_of(device_name)
    t = DistributeTranspiler()
    t.transpile(
        trainer_id, program=program(), pservers=",".join(endpoints), trainers=TRAINERS, sync_mode=True
    )
    losses = []
    with Trainer(t.get_trainer_program(), security=Security(), local_rank=0, local_world_size=1) as tr:
        on = {str(p.device) for p in tr.model.parameters()}
        for x, y in data:
            loss = nn.functional.cross_entropy(tr.model(x.to(tr.device)), y.to(tr.device))
            loss.backward()
            tr.step()
            losses.append(loss.item())
        pinned = list(tr.blocks._pinned_buffers.values())
        state = {k: v.detach().cpu() for k, v in tr.state_dict().items()}
    return {
        "device": str(tr.device),
        "params_on": sorted(on),
        "expected_device": str(device),
        "pinned": len(pinned),
        "all_pinned": all(b.is_pinned() for b in pinned),
        "losses": losses,
        "state": state,
        "tf32_off": tf32_off(),
    }


def reference(data, device: torch.device) -> Dict[str, torch.Tensor]:
    """One process on the device, every step on the trainers' batches concatenated."""
    prog = program()
    prog.model.to(device)
    on_device = [[(x.to(device), y.to(device)) for x, y in step] for step in data]
    return {k: v.cpu() for k, v in train_concatenated(prog, on_device).items()}


def run(args) -> Outcome:
    device = device_of(args.device)
    data = batches(TRAINERS, PER_TRAINER, STEPS)
    t0 = time.monotonic()
    with LocalCluster(program, PSERVERS, TRAINERS) as cluster, Children("pserver-mode trainers") as children:
        started = [
            children.start(
                f"trainer {i}", train_trainer, (cluster.endpoints, i, [step[i] for step in data], args.device)
            )
            for i in range(TRAINERS)
        ]
        results = children.wait(started, TIMEOUT)
    job_seconds = time.monotonic() - t0
    expected = reference(data, device)
    compared = [compare_states(r["state"], expected) for r in results]
    worst = max(diff for _, diff, _ in compared)
    on_device = all(r["device"] == str(device) and r["params_on"] == [str(device)] for r in results)
    # Pinned staging is what a GPU trainer does; the CPU has nothing to stage.
    pinned_ok = all(r["pinned"] > 0 and r["all_pinned"] for r in results) if device.type == "cuda" else True
    losses_ok = all(finite(r["losses"]) for r in results)
    figures = {
        "max_abs_diff": worst,
        "devices": sorted({r["device"] for r in results}),
        "pinned_buffers": [r["pinned"] for r in results],
        "tf32_off": all(r["tf32_off"] for r in results) and tf32_off(),
        "steps": STEPS,
        "job_seconds": round(job_seconds, 1),
    }
    bad = [
        f"trainer {i}: {key} outside rtol 1e-4/atol 1e-5" for i, (ok, _, key) in enumerate(compared) if not ok
    ]
    if not on_device:
        bad.append(f"a trainer was not on {device}: {[r['params_on'] for r in results]}")
    if not pinned_ok:
        bad.append("pushes and pulls did not all stage through pinned buffers")
    if not losses_ok:
        bad.append("a loss was not finite")
    return not bad, figures, "; ".join(bad)


def plan(device: str, quick: bool) -> Dict[str, object]:
    """What the stage runs; transpiles its program to the pservers it would use (nothing starts)."""
    t = DistributeTranspiler()
    t.transpile(0, program=program(), pservers="127.0.0.1:1,127.0.0.1:2", trainers=TRAINERS, sync_mode=True)
    blocks = len(t.get_trainer_program().blocks)
    return {
        "trainers": f"{TRAINERS} processes on {device}:0" if device == "cuda" else f"{TRAINERS} on cpu",
        "pservers": PSERVERS,
        "blocks": blocks,
        "steps": STEPS,
        "batch": PER_TRAINER,
        "against": "train_concatenated on one process",
        "tolerance": "rtol 1e-4, atol 1e-5",
    }


def main(argv=None) -> int:
    return run_worker(argv, __doc__, run, plan)


if __name__ == "__main__":
    sys.exit(main())
