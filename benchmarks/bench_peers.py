"""Both peer jobs against every peer in one run: a markdown table, a JSON file of every run, a PNG chart.

Usage::

    python -m benchmarks.bench_peers                       # everything, 3 rounds (see docs/performance.md)
    python -m benchmarks.bench_peers --rounds 1 --quick    # smoke test: few steps of every system
    python -m benchmarks.bench_peers --jobs S --systems torch-local,ours-sync
    python -m benchmarks.bench_peers --scaling             # job S, this project sync: trainers x pservers

The jobs and the peers come from ``shared/peers/`` (``--peers DIR``, default
``<repo>/../shared/peers``; see its README.md): ``jobs.py`` defines them,
``torch_peers.py`` and ``paddle_ps_ctr.py`` run the peers.

**Job S** (CTR: 26 Zipf slots in one shared dim-16 table, MLP 429-256-128-1,
SGD lr 0.05, batch 512 per trainer, 2 trainers, 20 warm-up + 200 timed steps,
AUC on a 20k hold-out), systems:

- ``torch-local``: one PyTorch process, ``nn.Embedding(sparse=True)``
  (``torch_peers.py local-ctr --batch 1024``, the global batch of 2 trainers;
  torch's default threads: both cores), the reference of the ratios when
  TorchRec did not run;
- ``torchrec``: TorchRec 1.8 on CPU, 2 processes over gloo, one thread each
  (``torchrec_ctr.py``: DistributedModelParallel, table-wise sharding, fbgemm's
  CPU kernels with SGD fused into backward, the MLP under DDP), run with the
  Python of ``--torchrec-python`` (default ``<tmp>/torchrec-venv/bin/python``,
  made by ``setup_torchrec.sh``); skipped, with a message, when it cannot
  import torchrec. The reference of job S's ratios when it ran;
- ``ours-async``, ``ours-sync``: this project, 2 pservers x 2 trainers
  (``ps-launch --server_num 2 --worker_num 2 benchmarks/jobs/job_s.py [--async]``),
  the loop the README recommends (``tr.batches(..., prefetch=)``);
  ``ours-async-plain``: async, the plain loop (``job_s.py --plain``: the
  batches read directly, each forward's lookup fetching its rows);
  ``ours-sync-bf16``: the same, sync, gradients pushed in bfloat16
  (``job_s.py --grad_wire_dtype bfloat16``);
- ``paddle-async``, ``paddle-sync``: PaddlePaddle 2.6.2's parameter server,
  2 pservers x 2 trainers (``paddle_ps_ctr.py --data jobs``; sync with
  ``--server-rt-prio 10``, which needs root), run with the Python of
  ``--paddle-python`` (default ``<tmp>/paddle26-venv/bin/python``, made by
  ``setup_paddle.sh``); skipped, with a message, when it cannot import paddle.

**Job D** (dense MLP 512-2048-2048-2048-10, 37.9 MB, SGD lr 0.01, batch 256
per trainer, 2 trainers, 5 warm-up + 30 timed steps, job D's data), systems:

- ``ddp``: DDP over gloo, 2 processes (``torch_peers.py ddp-dense``);
- ``rpc-ps``: the ``torch.distributed.rpc`` batch-updating parameter server,
  2 pservers (``torch_peers.py rpc-ps-dense --ps 2``);
- ``ours-sync``: this project, 2 pservers x 2 trainers, sync, default config
  (``common/dense_runs.run_ps`` with ``jobs/dense_workers.py`` on ``jobs.dense_batch``);
  ``ours-sync-bf16``: the same with ``grad_wire_dtype="bfloat16"``. Its
  figure next to ``ours-sync``'s final loss (mean over trainers of the loss
  at the last step, in the JSON) shows the accuracy cost of the narrow wire;
- ``ours-collective``: this project's collective mode, DDP through our
  ``Trainer`` (``ps-launch --worker_num 2 benchmarks/jobs/job_d_collective.py``),
  the same processes, threads and timing as ``ddp``.

Every system runs ``--rounds`` times (default 3); each round runs every
selected (job, system) once, in an order rotated by one each round, so the
machine's noise falls on all of them. Every run starts fresh processes on
127.0.0.1; every subprocess has a deadline (``--timeout``) and is killed with
its children (whole process tree, also processes in their own sessions) on
timeout, failure, Ctrl-C or SIGTERM; a failed run is recorded and the others go
on (exit status 1). Reported per system: the median examples/s (job D: samples
/s) with [min-max], the ratio of medians to TorchRec (job S; the single process
when TorchRec did not run) or to the better peer (job D: the faster of DDP and
the rpc PS), the hold-out AUC
(median), and the machine's *other load*: CPU cores busy with anything but
this benchmark (or stolen) during each run, from /proc/stat, the noise
indicator. Throughput everywhere = examples of all trainers / (latest end -
earliest start of the timed steps). Outputs: the markdown table on stdout
(and ``--md``), every run in ``--json`` (default ``benchmarks/results/peers-<today>.json``),
the chart in ``--png`` (default ``benchmarks/results/peers-<today>.png``; one panel per job,
bars = median, error bars = min-max, this project's bars highlighted).

``--scaling``: job S on this project, sync, trainers in ``--trainers``
(default 1,2,4) x pservers in ``--pservers`` (default 1,2,4), each the median
of ``--rounds`` rounds (configurations rotated each round as above), with the
per trainer per step figures its trainers report: calls to pservers, and
bytes pushed and pulled. Each trainer keeps batch 512, so the global batch
grows with the trainers. The machine has **2 cores**: every pserver and
trainer is a process on them, so where throughput stops growing (and where it
falls as processes are added) is part of the result, not a flaw of it.

Time at full length on the 2-core machine, nothing else running (estimated
from ``--quick`` runs: 10-25 s of start-up per run, plus the timed steps and
the untimed data generation): about 4 min a round of the all-peer run (12-15
min for 3 rounds) and about 5 min a round of the scaling table (about 15 min
for 3 rounds); more when the machine is shared.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
from typing import Dict, Iterable, List, Sequence, Tuple

from benchmarks.common.machine import OtherLoad
from benchmarks.common.paths import DEFAULT_PEERS, REPO, dated_result, peer_module
from benchmarks.common.peer_runners import RUNNERS, run_ours_s, venv_problem
from benchmarks.reports.peers import chart, peers_table, scaling_table
from harness.processes import RunFailed, stop_on_signals

log = logging.getLogger("bench_peers")

DEFAULT_PADDLE_PYTHON = os.path.join(tempfile.gettempdir(), "paddle26-venv", "bin", "python")
DEFAULT_TORCHREC_PYTHON = os.path.join(tempfile.gettempdir(), "torchrec-venv", "bin", "python")

SYSTEMS: Dict[str, List[str]] = {
    "S": [
        "torch-local",
        "torchrec",
        "ours-async",
        "ours-async-plain",
        "ours-sync",
        "ours-sync-bf16",
        "paddle-async",
        "paddle-sync",
    ],
    "D": ["ddp", "rpc-ps", "ours-sync", "ours-sync-bf16", "ours-collective"],
}


def measured(fn, args, workdir: str) -> dict:
    """Run ``fn(args, workdir)``; its figures plus ``wall_s`` and ``other_load`` (cores busy with other
    work)."""
    with OtherLoad() as load:
        out = fn(args, workdir)
    out["wall_s"] = load.wall
    out["other_load"] = load.cores
    return out


# -- driver ----------------------------------------------------------------------


def environment(args) -> dict:
    """What the run ran on: date, machine, versions, commit."""
    import torch

    commit = subprocess.run(
        ["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "commit": commit,
        "loadavg_at_start": os.getloadavg(),
        "peers": args.peers,
    }


def rounds_of(items: Sequence, rounds: int) -> Iterable[Tuple[int, object]]:
    """(round, item) for every item in every round, the order rotated by one each round."""
    for rnd in range(rounds):
        k = rnd % len(items)
        for item in list(items[k:]) + list(items[:k]):
            yield rnd, item


def run_peers(args, logdir: str) -> Tuple[List[dict], List[Tuple[str, str]], Dict[str, str]]:
    """The all-peer run: every selected (job, system), ``--rounds`` rounds; (rows, pairs, skipped systems)."""
    pairs = [(j, s) for j in args.jobs for s in SYSTEMS[j] if args.selected(j, s)]
    skipped: Dict[str, str] = {}
    for prefix, name, python, module, setup in (
        ("paddle", "PaddlePaddle", args.paddle_python, "paddle", "setup_paddle.sh"),
        ("torchrec", "TorchRec", args.torchrec_python, "torchrec", "setup_torchrec.sh"),
    ):
        if any(s.startswith(prefix) for _, s in pairs):
            problem = venv_problem(python, module, setup)
            if problem:
                print(f"skipping {name}: {problem}", file=sys.stderr, flush=True)
                skipped.update({s: f"skipped: {problem}" for _, s in pairs if s.startswith(prefix)})
    runnable = [p for p in pairs if p[1] not in skipped]
    if not runnable:
        raise SystemExit("nothing to run")
    rows: List[dict] = []
    for rnd, (job, system) in rounds_of(runnable, args.rounds):
        workdir = os.path.join(logdir, f"{rnd}-{job}-{system}")
        os.makedirs(workdir, exist_ok=True)
        row = {"round": rnd, "job": job, "system": system}
        try:
            row.update(measured(RUNNERS[(job, system)], args, workdir))
            auc = f", AUC {row['auc']:.3f}" if row.get("auc") is not None else ""
            auc += f", final loss {row['final_loss']:.4f}" if row.get("final_loss") is not None else ""
            print(
                f"  round {rnd} {job} {system:14s} {row['examples_s']:9,.0f} examples/s{auc} "
                f"(other load {row['other_load']:.2f} cores, {row['wall_s']:.0f} s)",
                flush=True,
            )
        except RunFailed as e:
            row["error"] = str(e)
            print(f"  round {rnd} {job} {system:13s} FAILED: {e}", file=sys.stderr, flush=True)
        rows.append(row)
        args.save(rows)
    return rows, pairs, skipped


def run_scaling(args, logdir: str) -> Tuple[List[dict], List[Tuple[int, int]]]:
    """The scaling run: this project, job S sync, every (pservers, trainers), ``--rounds`` rounds."""
    configs = [(ps, tr) for tr in args.trainers for ps in args.pservers]
    rows: List[dict] = []
    for rnd, (ps, tr) in rounds_of(configs, args.rounds):
        workdir = os.path.join(logdir, f"{rnd}-{ps}ps-{tr}tr")
        os.makedirs(workdir, exist_ok=True)
        row = {
            "round": rnd,
            "job": "S",
            "system": "ours-sync",
            "pservers": ps,
            "trainers": tr,
            "global_batch": args.s_batch * tr,
        }
        try:
            row.update(measured(lambda a, w: run_ours_s(a, w, True, ps, tr), args, workdir))
            print(
                f"  round {rnd} {ps} ps x {tr} trainers {row['examples_s']:9,.0f} examples/s, "
                f"{row['calls_per_step']:.1f} calls, {row['bytes_pushed_per_step'] / 1e3:,.0f} KB pushed, "
                f"{row['bytes_pulled_per_step'] / 1e3:,.0f} KB pulled per trainer per step "
                f"(other load {row['other_load']:.2f} cores, {row['wall_s']:.0f} s)",
                flush=True,
            )
        except RunFailed as e:
            row["error"] = str(e)
            print(f"  round {rnd} {ps} ps x {tr} trainers FAILED: {e}", file=sys.stderr, flush=True)
        rows.append(row)
        args.save(rows)
    return rows, configs


def _int_list(text: str) -> List[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="runs of every system, alternating (default 3)")
    p.add_argument("--jobs", default="S,D", help="jobs to run: S,D (default both)")
    p.add_argument(
        "--systems",
        default="",
        help="only these systems, comma-separated, e.g. torch-local,ours-sync or S:ours-sync "
        f"(job S: {', '.join(SYSTEMS['S'])}; job D: {', '.join(SYSTEMS['D'])})",
    )
    p.add_argument(
        "--scaling", action="store_true", help="the scaling table instead: this project, job S, sync"
    )
    p.add_argument("--trainers", type=_int_list, default=[1, 2, 4], help="--scaling: trainer counts (1,2,4)")
    p.add_argument("--pservers", type=_int_list, default=[1, 2, 4], help="--scaling: pserver counts (1,2,4)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: job S 3 warm-up + 20 timed steps and a 2000-example hold-out, "
        "job D 2 + 5 steps (unless given below)",
    )
    p.add_argument("--s-steps", type=int, help="job S timed steps (default jobs.S_STEPS, 200)")
    p.add_argument("--s-warmup", type=int, help="job S warm-up steps (default jobs.S_WARMUP, 20)")
    p.add_argument(
        "--s-eval",
        type=int,
        help="job S hold-out examples (default jobs.S_EVAL_N, 20000; local-ctr always uses 20000)",
    )
    p.add_argument("--d-steps", type=int, help="job D timed steps (default jobs.D_STEPS, 30)")
    p.add_argument("--d-warmup", type=int, help="job D warm-up steps (default jobs.D_WARMUP, 5)")
    p.add_argument("--peers", default=DEFAULT_PEERS, help="the peers' folder (default: %(default)s)")
    p.add_argument(
        "--paddle-python",
        default=DEFAULT_PADDLE_PYTHON,
        help="Python with paddlepaddle 2.6.2 (default: %(default)s)",
    )
    p.add_argument(
        "--torchrec-python",
        default=DEFAULT_TORCHREC_PYTHON,
        help="Python with torchrec 1.8 and fbgemm-gpu-cpu (default: %(default)s; made by "
        "shared/peers/setup_torchrec.sh)",
    )
    p.add_argument(
        "--paddle-retries",
        type=int,
        default=1,
        help="paddle_ps_ctr.py re-launches a run that fails or hangs this often (default 1)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="deadline of one run in s (default 600)")
    p.add_argument(
        "--json",
        help="every run's figures (default benchmarks/results/peers-<today>.json; "
        "--scaling: benchmarks/results/scaling-<today>.json)",
    )
    p.add_argument("--png", default=dated_result("peers", "png"), help="the chart (default: %(default)s)")
    p.add_argument("--no-png", dest="png", action="store_const", const=None, help="no chart")
    p.add_argument("--md", help="also write the markdown table here")
    p.add_argument(
        "--logdir", help="keep every run's logs here (default: a temp dir, removed unless a run failed)"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = p.parse_args(argv)
    args.jobs = [j.strip().upper() for j in args.jobs.split(",") if j.strip()]
    if not args.jobs or not set(args.jobs) <= set(SYSTEMS):
        p.error(f"--jobs takes S and/or D, got {args.jobs}")
    wanted = {s.strip() for s in args.systems.split(",") if s.strip()}
    known = {s for ss in SYSTEMS.values() for s in ss} | {f"{j}:{s}" for j, ss in SYSTEMS.items() for s in ss}
    if wanted - known:
        p.error(f"unknown --systems {sorted(wanted - known)}; known: {sorted(known)}")
    args.selected = lambda job, system: not wanted or system in wanted or f"{job}:{system}" in wanted
    if not any(args.selected(j, s) for j in args.jobs for s in SYSTEMS[j]) and not args.scaling:
        p.error("--jobs and --systems select nothing")
    if args.png and not args.scaling and importlib.util.find_spec("matplotlib") is None:
        # Said before the rounds run, not after minutes of them.
        p.error("the chart (--png) needs matplotlib: pip install -e '.[bench]', or pass --no-png")
    jobs = peer_module(args.peers, "jobs")
    quick = args.quick

    def pick(value, quick_default, default):
        return value if value is not None else (quick_default if quick else default)

    args.s_steps = pick(args.s_steps, 20, jobs.S_STEPS)
    args.s_warmup = pick(args.s_warmup, 3, jobs.S_WARMUP)
    args.s_eval = pick(args.s_eval, 2000, jobs.S_EVAL_N)
    args.s_batch = jobs.S_BATCH // 2  # jobs.S_BATCH (1024) is the global batch of 2 trainers
    args.d_steps = pick(args.d_steps, 5, jobs.D_STEPS)
    args.d_warmup = pick(args.d_warmup, 2, jobs.D_WARMUP)
    if (
        args.rounds < 1
        or min(args.s_steps, args.d_steps, args.s_eval) < 1
        or min(args.s_warmup, args.d_warmup) < 0
    ):
        p.error("--rounds, --*-steps and --s-eval must be >= 1, --*-warmup >= 0")
    if args.json is None:
        args.json = dated_result("scaling" if args.scaling else "peers")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    stop_on_signals()
    env = environment(args)
    logdir = args.logdir or tempfile.mkdtemp(prefix="bench_peers-")
    os.makedirs(logdir, exist_ok=True)
    what = "scaling" if args.scaling else "peers"
    settings = {
        "rounds": args.rounds,
        "s_warmup": args.s_warmup,
        "s_steps": args.s_steps,
        "s_batch_per_trainer": args.s_batch,
        "s_eval": args.s_eval,
        "d_warmup": args.d_warmup,
        "d_steps": args.d_steps,
    }

    def save(rows: List[dict]) -> None:
        with open(args.json, "w") as f:
            json.dump({"kind": what, "environment": env, "settings": settings, "runs": rows}, f, indent=1)

    args.save = save
    print(
        f"{what}: {args.rounds} rounds; job S {args.s_warmup}+{args.s_steps} steps of {args.s_batch} per "
        f"trainer, job D {args.d_warmup}+{args.d_steps} steps; logs in {logdir}",
        flush=True,
    )
    rows: List[dict] = []
    try:
        if args.scaling:
            rows, configs = run_scaling(args, logdir)
            table = scaling_table(rows, configs)
        else:
            rows, pairs, skipped = run_peers(args, logdir)
            table = peers_table(rows, pairs, skipped)
            if args.png:
                chart(
                    rows,
                    pairs,
                    args.png,
                    f"{env['date'][:10]}, {env['cpus']} cores, commit {env['commit']}, "
                    f"median of {args.rounds} alternating round{'s' * (args.rounds > 1)}",
                )
    except KeyboardInterrupt:
        print(f"interrupted; every child process stopped; logs in {logdir}", file=sys.stderr)
        return 130
    except SystemExit as e:
        if not isinstance(e.code, int) or e.code < 128:
            raise
        print(
            f"stopped by signal {e.code - 128}; every child process stopped; logs in {logdir}",
            file=sys.stderr,
        )
        return e.code
    failed = any("error" in r for r in rows)
    print()
    print(table)
    print(f"\nevery run: {args.json}" + (f"; chart: {args.png}" if args.png and not args.scaling else ""))
    if args.md:
        with open(args.md, "w") as f:
            f.write(table + "\n")
    if failed:
        print(f"some runs failed; logs kept in {logdir}", file=sys.stderr)
        return 1
    if not args.logdir:
        import shutil

        shutil.rmtree(logdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
