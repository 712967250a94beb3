"""Job S in each update mode with a straggler: sync (with and without backup trainers), async and GEO, 2 x 4.

    python -m benchmarks.bench_modes [--systems sync,sync-b1,async,geo-4,geo-16] [--rounds 3] [--slow_ms 40]
                                     [--paddle-geo]

Issue 36's measurement of the modes users pick at scale: job S (``benchmarks/jobs/job_s.py``,
``shared/peers/jobs.py``'s CTR job) through ``ps-launch`` with 2 pservers and 4 trainers, trainer 3
sleeping ``--slow_ms`` after each of its steps (a straggler: a busier host), every trainer training
the same number of examples (20 warm-up + 200 timed steps of 512). Per run: the job's examples/s
(all trainers' timed examples over the span from the first trainer's start to the last one's end),
the steps/s of the three full-speed trainers (median) and of the slow one, and the hold-out AUC
trainer 0 measures once every trainer's last push reached the pservers. Systems alternate round by
round; the report gives each figure's median over rounds.

``--paddle-geo`` also runs PaddlePaddle 2.6's GEO mode (``benchmarks/jobs/paddle_geo.py``, the peers'
``paddle_ps_ctr.py`` with ``a_sync_configs["k_steps"]``) on the same job, all trainers at full speed
(its training loop is Paddle's C++ ``train_from_dataset``, with no per-step hook to slow), with the
Python of ``--paddle-python``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional, Sequence, Tuple

from benchmarks.common.paths import DEFAULT_PEERS, REPO
from benchmarks.common.peer_runners import run_ours_s
from harness.processes import RunFailed

log = logging.getLogger("bench_modes")

DEFAULT_PADDLE_PYTHON = os.path.join(tempfile.gettempdir(), "paddle26-venv", "bin", "python")
PSERVERS, TRAINERS, SLOW = 2, 4, 3


def mode_of(system: str) -> Optional[Tuple[bool, List[str]]]:
    """(sync, more ``job_s.py`` arguments) of ``system`` (sync, sync-bB, async, geo-K); None: not one of
    ours."""
    if system in ("sync", "async"):
        return system == "sync", []
    if system.startswith("sync-b") and system[6:].isdigit() and int(system[6:]) >= 1:
        return True, ["--backup_trainers", system[6:]]
    if system.startswith("geo-") and system[4:].isdigit() and int(system[4:]) >= 1:
        return False, ["--k_steps", system[4:]]
    return None


def summarize(run: dict) -> dict:
    """A run's figures: job examples/s, the fast trainers' and the slow one's steps/s, AUC, bytes per step."""
    res = run["detail"]
    rate = {r["trainer_id"]: r["steps"] / (r["end"] - r["start"]) for r in res}
    return {
        "examples_s": run["examples_s"],
        "auc": run["auc"],
        "fast_steps_s": statistics.median(v for t, v in rate.items() if t != SLOW),
        "slow_steps_s": rate.get(SLOW),
        "calls_per_step": run["calls_per_step"],
        "bytes_pushed_per_step": run["bytes_pushed_per_step"],
    }


def run_paddle_geo(args, workdir: str, k: int) -> dict:
    """Paddle 2.6's GEO mode on job S (2 pservers x 4 trainers, full speed); RunFailed with its error if it
    fails."""
    out = os.path.join(workdir, "paddle.json")
    cmd = [
        args.paddle_python,
        os.path.join(REPO, "benchmarks", "jobs", "paddle_geo.py"),
        "--k_steps",
        str(k),
        "--peers",
        args.peers,
        "--mode",
        "async",
        "--data",
        "jobs",
        "--servers",
        str(PSERVERS),
        "--trainers",
        str(TRAINERS),
        "--steps",
        str(args.s_steps),
        "--warmup",
        str(args.s_warmup),
        "--batch",
        str(args.s_batch),
        "--eval-examples",
        str(args.s_eval),
        "--timeout",
        str(args.timeout),
        "--retries",
        "0",
        "--log-dir",
        os.path.join(workdir, "paddle"),
        "--out",
        out,
    ]
    subprocess.run(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        timeout=args.timeout + 120,
        stdin=subprocess.DEVNULL,
    )
    with open(out) as f:
        r = json.load(f)["runs"][-1]
    if "global_examples_per_s" not in r:
        raise RunFailed(f"Paddle GEO k_steps={k}: {r.get('error')}; logs in {r.get('log_dir')}")
    return {
        "examples_s": r["global_examples_per_s"],
        "auc": r.get("holdout_auc"),
        "fast_steps_s": None,
        "slow_steps_s": None,
        "calls_per_step": None,
        "bytes_pushed_per_step": None,
    }


def report(rows: Dict[str, List[dict]], failures: Dict[str, str], slow_ms: float) -> str:
    """The markdown table of medians over rounds; a system that failed is listed with its error."""
    lines = [
        f"| system | job examples/s | full-speed trainers, steps/s | slow trainer (+{slow_ms:g} ms/step), "
        f"steps/s | AUC | calls/step | bytes pushed/step | rounds |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def med(runs: List[dict], key: str) -> str:
        values = [r[key] for r in runs if r.get(key) is not None]
        if not values:
            return "-"
        m = statistics.median(values)
        return f"{m:.4f}" if key == "auc" else (f"{m:,.0f}" if m >= 100 else f"{m:.2f}")

    for system, runs in rows.items():
        lines.append(
            f"| {system} | {med(runs, 'examples_s')} | {med(runs, 'fast_steps_s')} | "
            f"{med(runs, 'slow_steps_s')} | {med(runs, 'auc')} | {med(runs, 'calls_per_step')} | "
            f"{med(runs, 'bytes_pushed_per_step')} | {len(runs)} |"
        )
    for system, error in failures.items():
        lines.append(f"| {system} | failed: {error.splitlines()[0][:160]} | | | | | | 0 |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--systems", default="sync,sync-b1,async,geo-4,geo-16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--slow_ms", type=float, default=40.0, help="trainer 3's sleep after each step (ms)")
    p.add_argument(
        "--paddle-geo", type=int, default=0, metavar="K", help="also Paddle 2.6's GEO with k_steps K"
    )
    p.add_argument("--paddle-python", default=DEFAULT_PADDLE_PYTHON)
    p.add_argument("--peers", default=DEFAULT_PEERS)
    p.add_argument("--s-steps", type=int, default=200)
    p.add_argument("--s-warmup", type=int, default=20)
    p.add_argument("--s-eval", type=int, default=20000)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", help="write every run's figures here")
    args = p.parse_args(argv)
    args.s_batch = 512
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    systems = args.systems.split(",")
    unknown = [s for s in systems if mode_of(s) is None]
    if unknown:
        p.error(f"unknown systems {unknown}: sync, sync-bB, async or geo-K")
    if args.paddle_geo:
        systems.append(f"paddle-geo-{args.paddle_geo}")
    rows: Dict[str, List[dict]] = {s: [] for s in systems}
    failures: Dict[str, str] = {}
    slow = ["--slow_trainer", str(SLOW), "--slow_ms", str(args.slow_ms)]
    with tempfile.TemporaryDirectory(prefix="bench_modes-") as work:
        for rnd in range(args.rounds):
            for system in systems:
                if system in failures:
                    continue
                workdir = os.path.join(work, f"{rnd}-{system}")
                os.makedirs(workdir)
                try:
                    if system.startswith("paddle-geo-"):
                        row = run_paddle_geo(args, workdir, args.paddle_geo)
                    else:
                        sync, more = mode_of(system)
                        row = summarize(
                            run_ours_s(
                                args,
                                workdir,
                                sync=sync,
                                pservers=PSERVERS,
                                trainers=TRAINERS,
                                extra=[*more, *slow],
                            )
                        )
                except (RunFailed, OSError, subprocess.SubprocessError) as e:
                    log.error("%s failed: %s", system, e)
                    failures[system] = str(e)
                    continue
                log.info("round %d %s: %s", rnd, system, row)
                rows[system].append(row)
    rows = {s: r for s, r in rows.items() if r}
    print(report(rows, failures, args.slow_ms))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"command": sys.argv, "slow_ms": args.slow_ms, "runs": rows, "failures": failures},
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
