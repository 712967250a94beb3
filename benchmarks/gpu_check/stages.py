"""The GPU check's stages: what each runs, with its own deadline, and how a dry run checks it.

Each stage is a subprocess (``pytest`` for the CUDA tests, a stage worker for the others) in
its own session, stopped with every process it started when its deadline passes
(:class:`harness.processes.Command`); a stage that fails or overruns leaves the
others to run. Deadlines are the GPU's, well above what the stages take there (about half a
minute each), and all of them together are held to the check's budget.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

from benchmarks.common.paths import REPO
from benchmarks.gpu_check.report import (
    FAIL,
    PASS,
    READY,
    StageResult,
    collected_count,
    pytest_counts,
    pytest_outcome,
)
from benchmarks.gpu_check.worker import PeersMissing, first_line, parser
from harness.paths import pythonpath_with_repo
from harness.processes import Command, RunFailed, run_command, tail

CUDA_TESTS = "tests/trainer/test_cuda.py"
# A stage is not started with less than this left of the budget: it could not even import torch.
MIN_STAGE_S = 20.0
COLLECT_TIMEOUT = 60.0


@dataclass(frozen=True)
class Stage:
    """One stage: its key (a-f), name, what it checks, its worker module (None: the CUDA tests) and
    deadlines."""

    key: str
    name: str
    what: str
    module: Optional[str]
    timeout: float  # on the GPU
    cpu_timeout: float  # the CPU simulation's (2 cores, everything slower)

    def deadline(self, device: str) -> float:
        return self.timeout if device == "cuda" else self.cpu_timeout


STAGES = (
    Stage(
        "a",
        "cuda-tests",
        f"pytest {CUDA_TESTS}: a trainer on its GPU through pinned buffers, a node's collectives on NCCL",
        None,
        150,
        150,
    ),
    Stage(
        "b",
        "pserver-gpu-trainers",
        "2 trainer processes on cuda:0, 2 CPU pservers, sync, against one GPU "
        "process on the concatenated batches",
        "benchmarks.gpu_check.pserver_stage",
        90,
        150,
    ),
    Stage(
        "c",
        "node-path",
        "a node's collectives over NCCL (a group of one) and over gloo with CUDA tensors "
        "(two ranks on cuda:0), and a whole 2-rank node against pservers",
        "benchmarks.gpu_check.node_stage",
        120,
        240,
    ),
    Stage(
        "d",
        "collective-job-d",
        "job D in collective mode (NCCL) against plain DDP: parameters, losses, steps/s",
        "benchmarks.gpu_check.collective_stage",
        90,
        150,
    ),
    Stage(
        "e",
        "job-s-ctr",
        "job S with 2 GPU trainers and 2 CPU pservers against one GPU process: examples/s and AUC",
        "benchmarks.gpu_check.ctr_stage",
        150,
        240,
    ),
    Stage(
        "f",
        "amp",
        "bf16 autocast with pservers (also bf16 on the wire) and fp16 with a GradScaler in collective mode",
        "benchmarks.gpu_check.amp_stage",
        90,
        150,
    ),
)


def select(keys: Optional[str]) -> List[Stage]:
    """The stages named by ``keys`` ("a,c,e"; None: all), in the check's order. ValueError for an unknown
    key."""
    if not keys:
        return list(STAGES)
    wanted = [k.strip() for k in keys.split(",") if k.strip()]
    known = {s.key for s in STAGES}
    unknown = [k for k in wanted if k not in known]
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}: the stages are {sorted(known)}")
    return [s for s in STAGES if s.key in wanted]


def command(
    stage: Stage, device: str, result: Optional[str] = None, quick: bool = False, plan: bool = False
) -> List[str]:
    """The command line that runs ``stage`` (from the repository root)."""
    if stage.module is None:
        return [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", CUDA_TESTS]
    cmd = [sys.executable, "-m", stage.module, "--device", device]
    if quick:
        cmd.append("--quick")
    if result:
        cmd += ["--result", result]
    if plan:
        cmd.append("--plan")
    return cmd


def child_env(device: str) -> Dict[str, str]:
    """The repository on PYTHONPATH; for the CPU simulation no GPU visible, so every Trainer picks the CPU."""
    env = {"PYTHONPATH": pythonpath_with_repo()}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def run_stage(stage: Stage, device: str, out_dir: str, quick: bool, budget_left: float) -> StageResult:
    """Run one stage within its deadline (and what is left of the budget); its row of the table."""
    timeout = min(stage.deadline(device), budget_left)
    if timeout < MIN_STAGE_S:
        return StageResult(
            stage.key, stage.name, FAIL, note=f"not run: {budget_left:.0f} s left of the budget"
        )
    logs = os.path.join(out_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    log_path = os.path.join(logs, f"{stage.key}-{stage.name}.log")
    result_path = os.path.join(logs, f"{stage.key}-{stage.name}.json")
    t0 = time.monotonic()
    try:
        with Command(command(stage, device, result_path, quick), log_path, child_env(device), cwd=REPO) as c:
            rc = c.wait(timeout, f"stage {stage.key} {stage.name}")
    except RunFailed:
        return StageResult(
            stage.key,
            stage.name,
            FAIL,
            seconds=time.monotonic() - t0,
            note=f"deadline of {timeout:.0f} s passed (stopped); log {log_path}",
        )
    seconds = time.monotonic() - t0
    if stage.module is None:
        with open(log_path, errors="replace") as f:
            counts = pytest_counts(f.read())
        ok = pytest_outcome(counts, rc, device)
        note = "" if ok else f"pytest exited {rc}; log {log_path}"
        return StageResult(stage.key, stage.name, PASS if ok else FAIL, dict(counts), seconds, note)
    try:
        with open(result_path) as f:
            result = json.load(f)
    except (OSError, ValueError):
        return StageResult(
            stage.key,
            stage.name,
            FAIL,
            seconds=seconds,
            note=f"no result (exit {rc}); log {log_path}: {tail(log_path, 3).strip()}",
        )
    return StageResult(
        stage.key,
        stage.name,
        PASS if result["ok"] and rc == 0 else FAIL,
        result["figures"],
        seconds,
        result["note"],
    )


def dry_check(stage: Stage, device: str, out_dir: str) -> StageResult:
    """Check ``stage`` would run: its worker imports, its command parses, its plan builds; the CUDA tests
    collect."""
    t0 = time.monotonic()
    try:
        if stage.module is None:
            logs = os.path.join(out_dir, "logs")
            os.makedirs(logs, exist_ok=True)
            cmd = command(stage, device)[:3] + ["--collect-only"] + command(stage, device)[3:]
            out = run_command(
                cmd,
                os.path.join(logs, f"{stage.key}-collect.log"),
                COLLECT_TIMEOUT,
                f"collecting {CUDA_TESTS}",
                child_env(device),
                cwd=REPO,
            )
            n = collected_count(out)
            if n <= 0:
                raise RunFailed(f"pytest --collect-only found no test in {CUDA_TESTS}")
            figures: Dict[str, object] = {"collected": n}
        else:
            worker = importlib.import_module(stage.module)
            args = parser(worker.__doc__ or "").parse_args(command(stage, device, "result.json")[3:])
            figures = worker.plan(args.device, args.quick)
    except PeersMissing as e:
        # A checkout without ../shared/peers (CI's): the stage imports and parses; the job definitions it
        # needs come with the tree to a GPU machine (.whl/peers), where their absence fails the stage.
        return StageResult(
            stage.key,
            stage.name,
            READY,
            {"jobs": "not here"},
            time.monotonic() - t0,
            note=f"plan not built: {first_line(e)}",
        )
    except Exception as e:  # the dry run reports every stage, each failure with its reason
        return StageResult(stage.key, stage.name, FAIL, seconds=time.monotonic() - t0, note=first_line(e))
    return StageResult(stage.key, stage.name, READY, figures, time.monotonic() - t0)
