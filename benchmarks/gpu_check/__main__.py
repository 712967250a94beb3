"""The GPU check: the CUDA path end to end in a few minutes on one GPU, one table at the end.

    bash benchmarks/gpu_check.sh                   # on the GPU machine (installs the carried wheels first)
    python -m benchmarks.gpu_check                 # the same, where the project's packages are installed
    python -m benchmarks.gpu_check --dry-run       # what a machine without a GPU does anyway
    python -m benchmarks.gpu_check --device cpu    # every stage on the CPU (gloo for NCCL): the simulation
    python -m benchmarks.gpu_check --fetch-wheels  # here, with network: fill .whl/ for the GPU machine

Stages, each a subprocess with its own deadline (a failure does not stop the others):

  a  the CUDA tests (tests/trainer/test_cuda.py)
  b  pserver mode: 2 trainer processes on cuda:0 (pinned staging), 2 CPU pservers, sync, against one
     GPU process on the concatenated batches (rtol 1e-4, atol 1e-5, TF32 off)
  c  the node path: NCCL as a group of one, the two-rank logic over gloo with CUDA tensors, a whole
     2-rank node against pservers
  d  job D in collective mode over NCCL against plain DDP: parameters, losses, steps/s
  e  job S with 2 GPU trainers against one GPU process: examples/s and AUC
  f  mixed precision: bf16 with pservers (and bf16 on the wire), fp16 with a GradScaler (collective)

It prints one table (stage, result, figures, seconds) and writes it to $OUT (else --out) as
gpu_check.md and gpu_check.json, with each stage's log under logs/. Exit status: 0 when every stage
passed (a dry run: when every stage would run), else 1; 2 for a usage error.

On a machine without a GPU it says so and makes a dry run: it imports every stage, parses its
command, builds its plan (programs transpiled, jobs' definitions loaded), and collects the CUDA
tests with ``pytest --collect-only``, running nothing.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

from benchmarks.common.paths import REPO
from benchmarks.gpu_check.report import (
    StageResult,
    exit_code,
    markdown_table,
    report_json,
    report_markdown,
    summary,
)
from benchmarks.gpu_check.stages import dry_check, run_stage, select
from harness.processes import stop_on_signals

log = logging.getLogger("gpu_check")

BUDGET_S = 450.0  # the whole check on a GPU: under 8 minutes, with room for the wheels' install before it


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="check that every stage would run; run none")
    p.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default=None,
        help="cuda (the default where torch sees a GPU) or cpu: the stages on the CPU, quick sizes",
    )
    p.add_argument(
        "--stages", default=None, help="comma-separated keys of the stages to run (default: all, a-f)"
    )
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        help=f"seconds for all stages together (default {BUDGET_S:.0f} on a GPU, none on the CPU)",
    )
    p.add_argument(
        "--out",
        default=None,
        help="where the table, JSON and logs go when $OUT is not set "
        "(default: a new folder under the temporary directory)",
    )
    p.add_argument(
        "--fetch-wheels",
        action="store_true",
        help="download the wheels the GPU machine lacks into .whl/ (needs the package index) and exit",
    )
    args = p.parse_args(argv)
    if args.budget is not None and args.budget <= 0:
        p.error("--budget must be positive")
    try:
        args.selected = select(args.stages)
    except ValueError as e:
        p.error(str(e))
    return args


def out_dir(args) -> str:
    """$OUT (the device machine's folder that comes back), else --out, else a new temporary folder."""
    path = os.environ.get("OUT") or args.out or tempfile.mkdtemp(prefix="gpu_check-")
    os.makedirs(path, exist_ok=True)
    return path


def _git_commit() -> str:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or "unknown"
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def header(mode: str) -> Dict[str, object]:
    """The machine and the versions the table was made with."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {
        "mode": mode,
        "gpu": gpu,
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "python": platform.python_version(),
        "host": platform.node(),
        "commit": _git_commit(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def write(results: List[StageResult], head: Dict[str, object], folder: str) -> None:
    with open(os.path.join(folder, "gpu_check.md"), "w") as f:
        f.write(report_markdown(results, head))
    with open(os.path.join(folder, "gpu_check.json"), "w") as f:
        f.write(report_json(results, head) + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.fetch_wheels:
        from benchmarks.gpu_check.wheels import fetch

        manifest = fetch()
        print(
            f"{len(manifest['wheels'])} wheels, {manifest['bytes'] / 2**20:.1f} MiB, in .whl/ "
            f"(peers' jobs.py: {'carried' if manifest['peers_jobs'] else 'missing'})"
        )
        return 0
    stop_on_signals()
    import torch

    has_gpu = torch.cuda.is_available()
    if args.device == "cuda" and not has_gpu:
        print("--device cuda: torch sees no GPU here", file=sys.stderr)
        return 2
    mode = "dry-run" if args.dry_run or (args.device is None and not has_gpu) else (args.device or "cuda")
    if mode == "dry-run" and not args.dry_run:
        print(
            "No GPU here (torch.cuda.is_available() is False): a dry run, checking that every stage would "
            "run (imports, commands, plans, the CUDA tests collected); nothing runs.",
            flush=True,
        )
    folder = out_dir(args)
    budget = args.budget or (BUDGET_S if mode == "cuda" else float("inf"))
    start = time.monotonic()
    results: List[StageResult] = []
    for stage in args.selected:
        print(f"stage {stage.key} {stage.name}: {stage.what}", flush=True)
        if mode == "dry-run":
            result = dry_check(stage, "cuda", folder)
        else:
            result = run_stage(
                stage, mode, folder, quick=mode == "cpu", budget_left=budget - (time.monotonic() - start)
            )
        print(
            f"stage {stage.key} {stage.name}: {result.outcome} ({result.seconds:.1f} s)"
            f"{': ' + result.note if result.note else ''}",
            flush=True,
        )
        results.append(result)
    head = {**header(mode), "seconds": round(time.monotonic() - start, 1)}
    write(results, head, folder)
    print()
    print(markdown_table(results))
    print(f"\n{summary(results)} in {head['seconds']} s ({mode}); written to {folder}/gpu_check.md and .json")
    return exit_code(results, mode)


if __name__ == "__main__":
    sys.exit(main())
