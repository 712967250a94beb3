"""Stage f: mixed precision on the GPU (docs/gpu.md, "Mixed precision").

Three short jobs, each checked for what the docs promise:

- ``bf16``: 2 pservers x 2 trainer processes on ``cuda:0``, sync, the forward pass under
  ``torch.autocast("cuda", dtype=torch.bfloat16)``: the logits are bf16, every loss is finite,
  the pservers' master parameters stay fp32, both trainers end with the same fp32 model;
- ``bf16-wire``: the same with ``grad_wire_dtype="bfloat16"`` (the gradients cast to bf16 on the
  GPU before the push, widened on the pservers): 2 bytes pushed a gradient element, not 4;
- ``fp16-scaler``: collective mode (a world of one, NCCL) under fp16 autocast with a
  ``torch.amp.GradScaler`` given to ``tr.step(scaler=)``: finite losses and scale, fp32 parameters.

On the CPU (``--device cpu``) the same runs with CPU autocast and gloo.

    python -m benchmarks.gpu_check.amp_stage --device cuda --result f.json
"""

from __future__ import annotations

import sys
from typing import Dict, List, Optional

import torch
from torch import nn

from benchmarks.gpu_check.worker import Children, Outcome, device_of, finite, first_line, run_worker
from harness.cluster import LocalCluster
from harness.models import batches, odd_mlp
from transpiler import DistributeTranspiler, DistributeTranspilerConfig, Program

TRAINERS, PSERVERS = 2, 2
PER_TRAINER, STEPS = 32, 6
TIMEOUT = 45.0  # each part's trainers; the three parts run one after the other within the stage's 90 s


def program() -> Program:
    return Program(odd_mlp(dtype=torch.float32), "momentum", lr=0.05, momentum=0.9)


def train_bf16(endpoints: List[str], trainer_id: int, data, device_name: str, wire: Optional[str]) -> dict:
    """One trainer process under bf16 autocast; its losses, logits dtype and final model."""
    from psproto.security import Security
    from trainer import Trainer

    device_of(device_name)
    t = DistributeTranspiler(DistributeTranspilerConfig(grad_wire_dtype=wire))
    t.transpile(
        trainer_id, program=program(), pservers=",".join(endpoints), trainers=TRAINERS, sync_mode=True
    )
    losses, dtypes = [], set()
    with Trainer(t.get_trainer_program(), security=Security(), local_rank=0, local_world_size=1) as tr:
        for x, y in data:
            with torch.autocast(tr.device.type, dtype=torch.bfloat16):
                logits = tr.model(x.to(tr.device))
                loss = nn.functional.cross_entropy(logits, y.to(tr.device))
            dtypes.add(str(logits.dtype))
            loss.backward()
            tr.step()
            losses.append(loss.item())
        state = {k: v.detach().cpu() for k, v in tr.state_dict().items()}
        pushed = tr.channels.bytes_pushed
    return {
        "losses": losses,
        "logits": sorted(dtypes),
        "state": state,
        "device": str(tr.device),
        "pushed": pushed,
    }


def run_bf16(children: Children, data, device_name: str, wire: Optional[str]) -> dict:
    config = DistributeTranspilerConfig(grad_wire_dtype=wire)
    with LocalCluster(program, PSERVERS, TRAINERS, config=config) as cluster:
        started = [
            children.start(
                f"bf16 trainer {i}{' (wire bf16)' if wire else ''}",
                train_bf16,
                (cluster.endpoints, i, [step[i] for step in data], device_name, wire),
            )
            for i in range(TRAINERS)
        ]
        results = children.wait(started, TIMEOUT)
        stores = [s.engine.store for s in cluster.servers]
        master = [t for store in stores for _, t in store.read(list(store.names()), copy=True)]
    a, b = results[0]["state"], results[1]["state"]
    numel = sum(t.numel() for t in a.values())
    per_element = results[0]["pushed"] / (STEPS * numel)  # every parameter has a gradient every step
    checks = {
        "wire_bytes": per_element == (2 if wire else 4),
        "losses_finite": all(finite(r["losses"]) for r in results),
        "logits_bf16": all(r["logits"] == ["torch.bfloat16"] for r in results),
        "master_fp32": bool(master) and all(t.dtype == torch.float32 for t in master),
        "trainers_equal_fp32": all(a[k].dtype == torch.float32 and torch.equal(a[k], b[k]) for k in a),
    }
    return {"checks": checks, "loss_last": results[0]["losses"][-1], "push_bytes_per_element": per_element}


def run_fp16_scaler(device: torch.device, data) -> dict:
    """Collective mode, a world of one, fp16 autocast with a GradScaler through ``tr.step(scaler=)``."""
    from trainer import Trainer

    t = DistributeTranspiler(DistributeTranspilerConfig(mode="collective"))
    t.transpile(0, program=program(), pservers=None, trainers=1)
    tr = Trainer(t.get_trainer_program(), local_rank=0, local_world_size=1)
    scaler = torch.amp.GradScaler(device.type)
    losses, dtypes = [], set()
    try:
        for step in data:
            x, y = (torch.cat([b[k] for b in step]).to(device) for k in (0, 1))
            with torch.autocast(device.type, dtype=torch.float16):
                logits = tr.model(x)
                loss = nn.functional.cross_entropy(logits, y)
            dtypes.add(str(logits.dtype))
            scaler.scale(loss).backward()
            tr.step(scaler=scaler)
            losses.append(loss.item())
        params = [p.dtype for p in tr.module.parameters()]
    finally:
        tr.close()
    checks = {
        "losses_finite": finite(losses),
        "logits_fp16": dtypes == {"torch.float16"},
        "scale_finite": finite([float(scaler.get_scale())]),
        "params_fp32": all(d == torch.float32 for d in params),
    }
    return {"checks": checks, "loss_last": losses[-1], "scale": float(scaler.get_scale())}


def run(args) -> Outcome:
    device = device_of(args.device)
    data = batches(TRAINERS, PER_TRAINER, STEPS)
    parts: Dict[str, dict] = {}
    with Children("mixed precision") as children:
        for name, call in (
            ("bf16", lambda: run_bf16(children, data, args.device, None)),
            ("bf16-wire", lambda: run_bf16(children, data, args.device, "bfloat16")),
            ("fp16-scaler", lambda: run_fp16_scaler(device, data)),
        ):
            try:
                parts[name] = call()
            except Exception as e:  # one part failing does not hide the others'
                parts[name] = {"checks": {}, "error": first_line(e)}
    ok = {name: bool(p["checks"]) and all(p["checks"].values()) for name, p in parts.items()}
    figures: Dict[str, object] = {name: "ok" if ok[name] else "FAIL" for name in parts}
    for name, p in parts.items():
        if "loss_last" in p:
            figures[f"{name}_loss_last"] = p["loss_last"]
        if "push_bytes_per_element" in p:
            figures[f"{name}_push_bytes_per_element"] = p["push_bytes_per_element"]
    if "scale" in parts.get("fp16-scaler", {}):
        figures["fp16_scale"] = parts["fp16-scaler"]["scale"]
    notes = [
        f"{n}: {p.get('error') or 'failed ' + ','.join(k for k, v in p['checks'].items() if not v)}"
        for n, p in parts.items()
        if not ok[n]
    ]
    return not notes, figures, "; ".join(notes)


def plan(device: str, quick: bool) -> Dict[str, object]:
    """What the stage runs; builds both configurations' plans (nothing starts)."""
    for wire in (None, "bfloat16"):
        t = DistributeTranspiler(DistributeTranspilerConfig(grad_wire_dtype=wire))
        t.transpile(
            0, program=program(), pservers="127.0.0.1:1,127.0.0.1:2", trainers=TRAINERS, sync_mode=True
        )
    DistributeTranspiler(DistributeTranspilerConfig(mode="collective")).transpile(
        0, program=program(), pservers=None, trainers=1
    )
    return {
        "parts": ["bf16", "bf16-wire", "fp16-scaler"],
        "trainers": TRAINERS,
        "pservers": PSERVERS,
        "steps": STEPS,
        "autocast": f"torch.autocast({device!r})",
    }


def main(argv=None) -> int:
    return run_worker(argv, __doc__, run, plan)


if __name__ == "__main__":
    sys.exit(main())
