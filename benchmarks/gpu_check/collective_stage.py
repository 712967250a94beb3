"""Stage d: job D in collective mode over NCCL against plain DDP with the same settings.

Job D (the peers' dense MLP 512-2048-2048-2048-10, SGD lr 0.01, cross-entropy, the batches of
``jobs.dense_batch``) trains twice in one process on the GPU, a world of one NCCL process
each time: through this project (``DistributeTranspilerConfig(mode="collective")`` ->
``Trainer``, a ``CollectiveTrainer`` wrapping DDP), then as a user writes plain DDP
(``init_process_group("nccl")``, ``DistributedDataParallel``, ``torch.optim.SGD``) with the
same bucket size. Both must end with the same parameters and losses (rtol 1e-4, atol 1e-5,
TF32 off); the figures are both runs' steps a second over the timed steps (after warm-up).

On the CPU (``--device cpu``) both runs use gloo.

    python -m benchmarks.gpu_check.collective_stage --device cuda --result d.json
"""

from __future__ import annotations

import datetime
import math
import sys
import time
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from benchmarks.gpu_check.worker import (
    Outcome,
    compare_states,
    device_of,
    finite,
    jobs_module,
    run_worker,
    tf32_off,
)
from benchmarks.jobs.job_d_collective import make_model
from transpiler import DistributeTranspiler, DistributeTranspilerConfig, Program

SIZES = {False: dict(warmup=10, steps=200, batch=256), True: dict(warmup=1, steps=4, batch=32)}  # by quick
SEED = 0


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def job_batches(jobs, device: torch.device, n: int, batch: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Job D's batches of rank 0 for ``n`` steps, on the device (generated before any timing)."""
    out = []
    for step in range(n):
        x, y = jobs.dense_batch(step, 0, batch, SEED)
        out.append((torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)))
    return out


def _timed(loop, warmup: int, device: torch.device) -> Tuple[List[float], float]:
    """Run ``loop(i)`` (one step, returns its loss tensor) over every batch; (losses, timed seconds)."""
    losses: List[torch.Tensor] = []
    t0 = 0.0
    for i in range(len(loop.batches)):
        if i == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
        losses.append(loop(i))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return [float(v) for v in losses], time.perf_counter() - t0


class OursLoop:
    """This project's collective trainer, one step per call."""

    def __init__(self, jobs, batches, device: torch.device):
        from trainer import Trainer

        config = DistributeTranspilerConfig(mode="collective")
        t = DistributeTranspiler(config)
        t.transpile(
            0, program=Program(make_model(jobs, SEED), "sgd", lr=jobs.D_LR), pservers=None, trainers=1
        )
        self.tr = Trainer(t.get_trainer_program(), local_rank=0, local_world_size=1)
        self.batches = batches
        self.bucket_cap_mb = config.bucket_cap_mb
        self.loss_fn = nn.CrossEntropyLoss()

    def __call__(self, i: int) -> torch.Tensor:
        x, y = self.batches[i]
        loss = self.loss_fn(self.tr.model(x), y)
        loss.backward()
        self.tr.step()
        return loss.detach()


class DdpLoop:
    """Plain DDP as a user writes it, with the same model, optimizer and bucket size."""

    def __init__(self, jobs, batches, device: torch.device, bucket_cap_mb: float):
        dist.init_process_group(
            backend_for(device),
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=60),
        )
        self.module = make_model(jobs, SEED).to(device)
        self.model = DistributedDataParallel(
            self.module, device_ids=[device] if device.type == "cuda" else None, bucket_cap_mb=bucket_cap_mb
        )
        self.opt = torch.optim.SGD(self.module.parameters(), lr=jobs.D_LR)
        self.batches = batches
        self.loss_fn = nn.CrossEntropyLoss()

    def __call__(self, i: int) -> torch.Tensor:
        x, y = self.batches[i]
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        self.opt.step()
        self.module.zero_grad(set_to_none=True)
        return loss.detach()


def run(args) -> Outcome:
    device = device_of(args.device)
    size = SIZES[args.quick]
    jobs = jobs_module()
    batches = job_batches(jobs, device, size["warmup"] + size["steps"], size["batch"])

    ours = OursLoop(jobs, batches, device)
    try:
        backend = dist.get_backend()
        ours_losses, ours_s = _timed(ours, size["warmup"], device)
        ours_state = {k: v.cpu() for k, v in ours.tr.state_dict().items()}
    finally:
        ours.tr.close()  # destroys the process group it made
    ddp = DdpLoop(jobs, batches, device, ours.bucket_cap_mb)
    try:
        ddp_losses, ddp_s = _timed(ddp, size["warmup"], device)
        ddp_state = {k: v.detach().cpu() for k, v in ddp.module.state_dict().items()}
    finally:
        dist.destroy_process_group()

    same, worst, key = compare_states(ours_state, ddp_state)
    loss_diff = max(abs(a - b) for a, b in zip(ours_losses, ddp_losses))
    steps = size["steps"]
    figures: Dict[str, object] = {
        "backend": backend,
        "ours_steps_per_s": steps / ours_s,
        "ddp_steps_per_s": steps / ddp_s,
        "ours_vs_ddp": ddp_s / ours_s,
        "max_abs_diff": worst,
        "loss_last": ours_losses[-1],
        "max_loss_diff": loss_diff,
        "steps": steps,
        "batch": size["batch"],
        "tf32_off": tf32_off(),
    }
    bad = []
    if not same:
        bad.append(f"parameters differ from plain DDP at {key}")
    if not (finite(ours_losses) and finite(ddp_losses)) or not math.isclose(
        ours_losses[-1], ddp_losses[-1], rel_tol=1e-4, abs_tol=1e-5
    ):
        bad.append(f"losses differ or are not finite (last: {ours_losses[-1]} against {ddp_losses[-1]})")
    if backend != backend_for(device):
        bad.append(f"the collective trainer used {backend}, not {backend_for(device)}")
    return not bad, figures, "; ".join(bad)


def plan(device: str, quick: bool) -> Dict[str, object]:
    """What the stage runs; loads job D's definition and builds its program (nothing trains)."""
    jobs = jobs_module()
    t = DistributeTranspiler(DistributeTranspilerConfig(mode="collective"))
    t.transpile(0, program=Program(make_model(jobs, SEED), "sgd", lr=jobs.D_LR), pservers=None, trainers=1)
    params = sum(p.numel() for p in t.get_trainer_program().model.parameters())
    return {
        "model": "x".join(map(str, jobs.D_SIZES)),
        "params": params,
        "backend": backend_for(torch.device(device)),
        "world": 1,
        **SIZES[quick],
        "against": "plain DDP, same bucket size",
        "tolerance": "rtol 1e-4, atol 1e-5",
    }


def main(argv=None) -> int:
    return run_worker(argv, __doc__, run, plan)


if __name__ == "__main__":
    sys.exit(main())
