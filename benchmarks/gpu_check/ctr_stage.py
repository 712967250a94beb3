"""Stage e: job S (the CTR job) with trainers on the GPU against one GPU process training the same model.

Job S as ``benchmarks/jobs/job_s.py`` defines it (one shared dim-16 distributed table over 26
slots, MLP 429-256-128-1, SGD lr 0.05, BCE, batch 512 per trainer, 20 warm-up + 200 timed steps,
``tr.batches(..., prefetch=)``), sync, 2 pserver processes on the CPU and 2 trainer processes
on ``cuda:0`` (dense features, labels and the looked-up rows on the GPU; ids stay on the CPU),
one torch thread per role as in the job. Against it, one process on the GPU trains the same
model on the same 1,024 examples a step (both trainers' batches): ``nn.Embedding(sparse=True)``
over every id the data holds, its rows initialised as the pservers initialise them (same seed,
same values), torch's sparse SGD, ids mapped to rows inside the timed step (as the peers'
``local-ctr`` does). Figures: examples a second of both, and both hold-out AUCs, which must agree
within 0.01.

    python -m benchmarks.gpu_check.ctr_stage --device cuda --result e.json
"""

from __future__ import annotations

import math
import sys
import time
from typing import Callable, Dict, List

import numpy as np
import torch
from torch import nn

from benchmarks.gpu_check.worker import Children, Outcome, device_of, finite, jobs_module, run_worker
from benchmarks.jobs.job_s import wait_for_trainers
from benchmarks.jobs.job_s_program import TABLE, CtrNet, build_program, make_batches
from harness.ports import free_ports
from transpiler import DistributeTranspiler
from transpiler.tables import initial_rows

TRAINERS, PSERVERS = 2, 2
SIZES = {
    False: dict(warmup=20, steps=200, batch=512, eval=20000),  # the job's own
    True: dict(warmup=2, steps=12, batch=128, eval=4000),
}
SEED = 0
AUC_TOLERANCE = 0.01
TIMEOUT = 110.0  # the trainers, start to end: under the stage's own deadline (150 s), so a hang is reported


def transpiled(jobs, endpoints: List[str], trainer_id: int) -> DistributeTranspiler:
    t = DistributeTranspiler()  # the job's default configuration
    t.transpile(
        trainer_id,
        program=build_program(jobs, SEED),
        pservers=",".join(endpoints),
        trainers=TRAINERS,
        sync_mode=True,
    )
    return t


def serve_pserver(endpoints: List[str], index: int) -> dict:
    """One pserver process; returns when both trainers closed."""
    from pserver import ParameterServer
    from psproto.security import Security

    torch.set_num_threads(1)
    t = transpiled(jobs_module(), endpoints, 0)
    ep = endpoints[index]
    prog = t.get_pserver_program(ep)
    ParameterServer(prog, t.get_startup_program(ep, prog), security=Security()).serve()
    return {"endpoint": ep}


def auc_of(forward: Callable[[np.ndarray, np.ndarray], torch.Tensor], jobs, n: int) -> float:
    """Hold-out AUC on ``jobs.ctr_eval_set(n)``; ``forward(ids, dense)`` gives the logits."""
    ids, dense, y = jobs.ctr_eval_set(n, seed=SEED, return_logit=False)
    scores = []
    with torch.no_grad():
        for s in range(0, len(y), 4096):
            scores.append(forward(ids[s : s + 4096], dense[s : s + 4096]).float().cpu().numpy())
    return float(jobs.auc(y, np.concatenate(scores).astype(np.float64)))


def train_trainer(endpoints: List[str], trainer_id: int, size: dict, device_name: str) -> dict:
    """One trainer process of job S on the device; trainer 0 also evaluates the AUC."""
    from psproto.security import Security
    from trainer import Trainer

    device_of(device_name)  # TF32 off, and no GPU when one was asked for fails here; the Trainer picks cuda:0
    torch.set_num_threads(1)
    jobs = jobs_module()
    total = size["warmup"] + size["steps"]
    data = make_batches(jobs, trainer_id, TRAINERS, total, size["batch"], SEED)
    loss_fn = nn.BCEWithLogitsLoss()
    losses: List[float] = []
    start = end = 0.0
    with Trainer(
        transpiled(jobs, endpoints, trainer_id).get_trainer_program(),
        security=Security(),
        local_rank=0,
        local_world_size=1,
    ) as tr:
        wait_for_trainers(endpoints, TRAINERS, 60.0)
        for i, (ids, dense, y) in enumerate(tr.batches(data, 1, prefetch=lambda b: {TABLE: b[0]})):
            if i == size["warmup"]:
                start = time.time()
            loss = loss_fn(tr.model(ids, dense.to(tr.device)), y.to(tr.device))
            loss.backward()
            tr.step()
            losses.append(loss.item())
        end = time.time()
        auc = float("nan")
        if trainer_id == 0:
            tr.model.eval()
            auc = auc_of(
                lambda i, d: tr.model(torch.from_numpy(i), torch.from_numpy(d).to(tr.device)),
                jobs,
                size["eval"],
            )
        on = sorted({str(p.device) for p in tr.model.parameters()})
    return {
        "start": start,
        "end": end,
        "examples": size["steps"] * size["batch"],
        "losses": losses,
        "auc": auc,
        "device": str(tr.device),
        "params_on": on,
    }


class LocalCtr(nn.Module):
    """Job S's model in one process: a real ``nn.Embedding(sparse=True)`` over the ids the data holds."""

    def __init__(self, jobs, vocab: np.ndarray, spec):
        super().__init__()
        self.mlp = CtrNet(jobs, SEED).mlp  # seeded: the weights the pservers start from
        self.emb = nn.Embedding(len(vocab), spec.dim, sparse=True)
        with torch.no_grad():
            self.emb.weight.copy_(torch.from_numpy(initial_rows(spec, vocab)))

    def forward(self, rows: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        e = self.emb(rows).reshape(rows.shape[0], -1)
        return self.mlp(torch.cat([e, dense], dim=1)).squeeze(1)


def reference(jobs, size: dict, device: torch.device) -> dict:
    """One process on the device, each step on both trainers' batches of that step concatenated."""
    torch.set_num_threads(1)
    total = size["warmup"] + size["steps"]
    per = [make_batches(jobs, r, TRAINERS, total, size["batch"], SEED) for r in range(TRAINERS)]
    data = [tuple(torch.cat([per[r][t][k] for r in range(TRAINERS)]) for k in range(3)) for t in range(total)]
    eval_ids = jobs.ctr_eval_set(size["eval"], seed=SEED, return_logit=False)[0]
    vocab = np.unique(np.concatenate([d[0].numpy().ravel() for d in data] + [eval_ids.ravel()]))
    spec = next(
        s
        for s in transpiled(jobs, ["127.0.0.1:1", "127.0.0.1:2"], 0).get_trainer_program().tables
        if s.name == TABLE
    )
    model = LocalCtr(jobs, vocab, spec).to(device)
    opt_e = torch.optim.SGD(model.emb.parameters(), lr=jobs.S_LR)
    opt_m = torch.optim.SGD(model.mlp.parameters(), lr=jobs.S_LR)
    loss_fn = nn.BCEWithLogitsLoss()
    losses: List[float] = []
    t0 = time.perf_counter()
    for i, (ids, dense, y) in enumerate(data):
        if i == size["warmup"]:
            t0 = time.perf_counter()
        rows = torch.from_numpy(np.searchsorted(vocab, ids.numpy())).to(device)
        loss = loss_fn(model(rows, dense.to(device)), y.to(device))
        opt_e.zero_grad(set_to_none=True)
        opt_m.zero_grad(set_to_none=True)
        loss.backward()
        opt_e.step()
        opt_m.step()
        losses.append(loss.item())
    seconds = time.perf_counter() - t0
    model.eval()
    auc = auc_of(
        lambda i, d: model(
            torch.from_numpy(np.searchsorted(vocab, i)).to(device), torch.from_numpy(d).to(device)
        ),
        jobs,
        size["eval"],
    )
    return {
        "examples_per_s": size["steps"] * size["batch"] * TRAINERS / seconds,
        "auc": auc,
        "losses": losses,
        "rows": int(len(vocab)),
    }


def run(args) -> Outcome:
    device = device_of(args.device)
    size = SIZES[args.quick]
    jobs = jobs_module()
    endpoints = [f"127.0.0.1:{p}" for p in free_ports(PSERVERS)]
    with Children("job S") as children:
        servers = [children.start(f"pserver {i}", serve_pserver, (endpoints, i)) for i in range(PSERVERS)]
        trainers = [
            children.start(f"trainer {i}", train_trainer, (endpoints, i, size, args.device))
            for i in range(TRAINERS)
        ]
        results = children.wait(trainers, TIMEOUT)
        children.wait(servers, 30.0)  # they return once both trainers closed
    ours_rate = sum(r["examples"] for r in results) / (
        max(r["end"] for r in results) - min(r["start"] for r in results)
    )
    ours_auc = results[0]["auc"]
    ref = reference(jobs, size, device)
    figures: Dict[str, object] = {
        "ours_examples_per_s": ours_rate,
        "one_process_examples_per_s": ref["examples_per_s"],
        "ours_vs_one": ours_rate / ref["examples_per_s"],
        "ours_auc": ours_auc,
        "one_auc": ref["auc"],
        "trainer0_loss_last": results[0]["losses"][-1],
        "one_loss_last": ref["losses"][-1],
        "steps": size["steps"],
        "batch": size["batch"],
        "table_rows": ref["rows"],
        "devices": sorted({r["device"] for r in results}),
    }
    bad = []
    if (
        not all(math.isfinite(a) for a in (ours_auc, ref["auc"]))
        or abs(ours_auc - ref["auc"]) > AUC_TOLERANCE
    ):
        bad.append(f"AUC {ours_auc:.4f} against one process's {ref['auc']:.4f} (tolerance {AUC_TOLERANCE})")
    if not all(finite(r["losses"]) for r in results) or not finite(ref["losses"]):
        bad.append("a loss was not finite")
    if any(r["params_on"] != [str(device)] for r in results):
        bad.append(
            f"the trainers' dense parameters were on {[r['params_on'] for r in results]}, not {device}"
        )
    return not bad, figures, "; ".join(bad)


def plan(device: str, quick: bool) -> Dict[str, object]:
    """What the stage runs; loads job S's definition and transpiles it (nothing starts)."""
    jobs = jobs_module()
    prog = transpiled(jobs, ["127.0.0.1:1", "127.0.0.1:2"], 0).get_trainer_program()
    return {
        "trainers": TRAINERS,
        "pservers": PSERVERS,
        "tables": [s.name for s in prog.tables],
        **SIZES[quick],
        "against": "one process, nn.Embedding(sparse=True)",
        "auc_tolerance": AUC_TOLERANCE,
    }


def main(argv=None) -> int:
    return run_worker(argv, __doc__, run, plan)


if __name__ == "__main__":
    sys.exit(main())
