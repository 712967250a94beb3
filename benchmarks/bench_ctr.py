"""CTR job end to end: 2 pservers x 2 trainers (async, sync) against single-process PyTorch.

Usage::

    python -m benchmarks.bench_ctr [--runs 5] [--steps 300] [--batch_size 1024] [--configs local,async,sync]

Every run starts the real example, ``examples/train_ctr.py`` (Wide & Deep over two distributed
tables, generated Criteo-layout data), in fresh processes:

- ``local``: ``python examples/train_ctr.py``: one process, ``nn.Embedding(sparse=True)`` with
  torch's Adagrad on the tables and Adam on the MLP, torch's default threads (2 here);
- ``async`` / ``sync``: ``ps-launch --server_num 2 --worker_num 2 examples/train_ctr.py [--async]``,
  one torch thread per role, batch ``--batch_size`` per trainer; ``async+tb`` / ``sync+tb``: the
  same with ``--tensorboard_dir`` (what writing TensorBoard scalars costs).

Each run does ``--warmup`` untimed steps, then ``--steps`` timed ones; the example prints a
RESULT line per trainer (examples and wall-clock interval of its timed steps). Throughput is all
trainers' timed examples / (last end - first start). Configurations are interleaved round by
round (the order rotates), and the table gives medians [min-max] over rounds, plus the "other
load" (CPU cores busy with something else during the run: the noise indicator of a shared box).
A run that fails or exceeds ``--timeout`` stops the benchmark with its log; ps-launch stops every
role it started, also when this script is interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Dict, List

from benchmarks.common.machine import OtherLoad
from benchmarks.common.paths import REPO
from harness.processes import die_with_parent

EXAMPLE = os.path.join(REPO, "examples", "train_ctr.py")
CONFIGS = ("local", "async", "sync", "async+tb", "sync+tb")


def command(config: str, args, workdir: str) -> List[str]:
    common = [
        EXAMPLE,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--batch_size",
        str(args.batch_size),
        "--train_examples",
        str(args.train_examples),
        "--test_examples",
        "5000",
        "--epochs",
        "100",
        "--no_progress",
        "--no_save",
        "--target_auc",
        "0",
    ]
    if config == "local":
        return [sys.executable] + common
    launch = [
        sys.executable,
        "-m",
        "trainer.launch",
        "--server_num",
        "2",
        "--worker_num",
        "2",
        "--show",
        "none",
        "--log_dir",
        os.path.join(workdir, "logs"),
    ]
    # No job-wide training AUC: the one-process run has none, and the figures stay those of earlier rounds.
    mode, _, board = config.partition("+")
    if board:  # "+tb": trainer 0 writes TensorBoard scalars (docs/tensorboard.md) into the run's folder
        launch += ["--tensorboard_dir", os.path.join(workdir, "tb")]
    return launch + common + ["--metrics_every", "0"] + (["--async"] if mode == "async" else [])


def results(output: str) -> List[dict]:
    return [json.loads(line.split("RESULT ", 1)[1]) for line in output.splitlines() if "RESULT " in line]


def run(config: str, args, workdir: str) -> Dict[str, float]:
    """One run of ``config``; its examples/s and the other load on the machine."""
    os.makedirs(workdir, exist_ok=True)
    out_path = os.path.join(workdir, "out.log")
    with OtherLoad() as load, open(out_path, "w") as out:
        proc = subprocess.Popen(
            command(config, args, workdir),
            cwd=workdir,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
        )
        try:
            code = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()  # ps-launch stops its roles on SIGTERM
            proc.wait(timeout=30)
            raise SystemExit(f"{config} run exceeded {args.timeout}s; log in {out_path}")
    text = open(out_path).read()
    if config != "local":
        logs = os.path.join(workdir, "logs")
        text += "".join(
            open(os.path.join(logs, f)).read() for f in sorted(os.listdir(logs)) if f.startswith("workerlog")
        )
    found = results(text)
    expected = 1 if config == "local" else 2
    if code != 0 or len(found) != expected:
        raise SystemExit(f"{config} run failed (exit {code}, {len(found)} RESULT lines); log in {workdir}")
    examples = sum(r["examples"] for r in found)
    seconds = max(r["end"] for r in found) - min(r["start"] for r in found)
    return {"examples_s": examples / seconds, "other_load": load.cores}


def fmt(values: List[float], spec: str) -> str:
    return f"{statistics.median(values):{spec}} [{min(values):{spec}}-{max(values):{spec}}]"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5, help="rounds of every configuration (default %(default)s)")
    p.add_argument("--steps", type=int, default=300, help="timed steps per trainer (default %(default)s)")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps first (default %(default)s)")
    p.add_argument("--batch_size", type=int, default=1024, help="per trainer (and of the local run)")
    p.add_argument("--train_examples", type=int, default=400_000, help="generated, all trainers together")
    p.add_argument(
        "--configs",
        default="local,async,sync",
        help="comma-separated, of local, async, sync, and "
        "async+tb, sync+tb: the same with TensorBoard on (default %(default)s)",
    )
    p.add_argument(
        "--timeout", type=float, default=600, help="deadline of one run in s (default %(default)s)"
    )
    p.add_argument("--logdir", help="keep every run's logs here (default: a temporary folder)")
    p.add_argument("--json", help="write every run's figures here")
    args = p.parse_args(argv)
    configs = args.configs.split(",")
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        p.error(f"--configs: unknown {unknown}; choose among {', '.join(CONFIGS)}")
    logdir = args.logdir or tempfile.mkdtemp(prefix="bench_ctr-")
    print(
        f"CTR Wide & Deep, batch {args.batch_size}, {args.warmup} warmup + {args.steps} timed steps, "
        f"{args.runs} rounds of {', '.join(configs)}; logs in {logdir}",
        flush=True,
    )
    rows: Dict[str, List[Dict[str, float]]] = {c: [] for c in configs}
    for rnd in range(args.runs):
        k = rnd % len(configs)
        for config in configs[k:] + configs[:k]:
            row = run(config, args, os.path.join(logdir, f"{rnd}-{config}"))
            rows[config].append(row)
            print(
                f"  round {rnd} {config:8s} {row['examples_s']:8.0f} examples/s "
                f"(other load {row['other_load']:.2f} cores)",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": rows}, f, indent=1)
    base = statistics.median(r["examples_s"] for r in rows["local"]) if "local" in rows else None
    print("\n| configuration | examples/s | vs single process | other load, cores |")
    print("|---|---|---|---|")
    for config in configs:
        rates = [r["examples_s"] for r in rows[config]]
        ratio = f"{statistics.median(rates) / base:.2f}x" if base else "-"
        print(
            f"| {config} | {fmt(rates, '.0f')} | {ratio} | "
            f"{fmt([r['other_load'] for r in rows[config]], '.2f')} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
