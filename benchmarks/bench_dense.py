"""Dense MLP: parameter servers (plain trainers, trainer nodes; sync / async) against DDP over gloo.

Usage::

    python -m benchmarks.bench_dense [--processes 4] [--nproc_per_node 2] [--runs 5] [--steps 20]
                                     [--modes sync,async] [--quick]

Every configuration runs the same number ``P`` of worker processes
(``--processes``, default 4), each on its own batches (the data of global
index ``r``, so the same index sees the same data everywhere):

- ``ddp``: ``P`` DDP ranks over gloo (MASTER_ADDR=127.0.0.1, a free port);
- ``ps-<mode>``: two pservers (``ParameterServer(...).serve()``) and ``P``
  plain trainers, set up through Paddle's role variables;
- ``ps-<mode>-node``: two pservers and ``P / L`` trainer nodes of ``L``
  local processes (``--nproc_per_node``, default 2 for an even ``P`` > 2), set up
  through ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``
  as ps-launch and torchrun do: a node's processes reduce-scatter their
  gradients over gloo, each pushes and pulls its share (the pservers see
  ``P / L`` trainers), and they all-gather the fresh parameters. Global
  index of local rank ``l`` of node ``n``: ``n * L + l``.

``--processes 2`` (``--nproc_per_node`` then defaults to 1: no node
configuration) is the older job of 2 pservers x 2 trainers vs DDP on 2 ranks.

Every run starts fresh OS processes on loopback. Each worker does ``warmup``
untimed steps, then ``steps`` timed ones (see ``jobs/dense_workers.py``). Runs of
the configurations are interleaved round by round (the order rotates each
round), so machine noise hits all of them; the tables give medians with
min/max. The script exits non-zero if any run fails; every child process is
stopped on success, failure, Ctrl-C or SIGTERM, and every wait has a deadline.

Figures per configuration (medians over runs, some with [min-max]):

- samples/s: samples of all worker processes / wall time of the timed steps of
  the slowest one; "vs DDP" as the ratio of the medians, and as the median
  [min-max] of the per-round ratios (each PS run / the DDP run of its round);
  for a node configuration also per-round ratios against the plain trainers
  of the same mode.
- push+pull GB/s per process: (bytes pushed + pulled during the timed steps)
  / time inside ``tr.step()``, averaged over trainer processes.
- bytes pushed per step (``tr.channels.bytes_pushed``): per process; per node,
  the sum over the node's processes (a plain trainer is a node of its own,
  which is what the pservers count as a trainer); and per ``L`` processes
  (global indices ``kL .. kL+L-1``: one host of ``L`` GPUs, whether they run
  as one node or as ``L`` plain trainers), with its ratio node / plain
  (expected ``1/L``: a node pushes its reduced gradient once).
- other load: CPU cores busy with other work (or stolen) during the run,
  from /proc/stat minus this script's processes: the noise indicator.
- time split, ms per step, averaged over workers: the step; forward+backward;
  the update (``tr.step()``; for DDP ``opt.step()`` + ``zero_grad``, as its
  all-reduce runs inside backward and so counts as fwd+bwd) and its share of
  the step. For the parameter server, ``tr.step()`` further split per pserver
  call (the calls to the pservers run in parallel; a node's local rank calls
  only its own pservers): push; pull until its first tensor arrives (in sync
  mode: the wait for the other trainers and the update); the rest of the
  pull; for nodes, the node's reduce-scatter + all-gather (waits for the
  other local ranks included).
- worker CPU: CPU ms of one DDP rank or trainer process per timed step, all
  threads, and of it the main thread (forward/backward); the rest is gloo or gRPC.
- pserver CPU: CPU ms of one pserver per training step while serving
  (warmup steps included).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
from typing import List

from benchmarks.common.dense_runs import PSERVERS, run_ddp, run_ps
from benchmarks.common.machine import OtherLoad
from benchmarks.jobs.dense_workers import Spec, param_bytes
from benchmarks.reports.dense import loss_check, summarize, tables
from harness.processes import RunFailed, stop_on_signals

QUICK_SIZES = (64, 256, 256, 10)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=None, help="runs per configuration (default 5; quick 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default 20; quick 5)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; quick 1)")
    p.add_argument(
        "--processes",
        type=int,
        default=4,
        help="worker processes of every configuration: DDP ranks, plain trainers, and the "
        "local processes of all trainer nodes together (default 4; 2 is the older "
        "2-trainer job)",
    )
    p.add_argument(
        "--nproc_per_node",
        type=int,
        default=None,
        help="local processes per trainer node of the ps-<mode>-node configurations "
        "(default 2 when --processes is even and > 2, else 1; 1 runs no node configuration)",
    )
    p.add_argument("--modes", default="sync,async", help="parameter-server modes: sync,async")
    p.add_argument("--no-ddp", dest="ddp", action="store_false", help="skip the DDP baseline")
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke test: MLP {'-'.join(map(str, QUICK_SIZES))}, batch 32, 1 run",
    )
    p.add_argument(
        "--timeout", type=float, default=None, help="deadline of one run in s (default 600; quick 120)"
    )
    p.add_argument("--json", help="also write every run's figures here")
    p.add_argument("--logdir", help="keep worker logs here (default: a temp dir, kept on failure)")
    p.add_argument(
        "--py-spy",
        dest="py_spy",
        metavar="DIR",
        help="record each pserver and trainer with py-spy (raw collapsed stacks) "
        "into DIR/<round>-<config>-<name>.txt",
    )
    p.add_argument(
        "--py-spy-args",
        default="--threads --rate 100",
        help="py-spy record options (default: %(default)s, i.e. on-CPU samples "
        "only; add --idle for wall-clock, --native for C/C++ frames)",
    )
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not set(modes) <= {"sync", "async"}:
        p.error(f"--modes takes sync and/or async, got {args.modes!r}")
    if args.processes < 1:
        p.error("--processes must be >= 1")
    if args.nproc_per_node is None:
        args.nproc_per_node = 2 if args.processes > 2 and args.processes % 2 == 0 else 1
    if args.nproc_per_node < 1 or args.processes % args.nproc_per_node:
        p.error(
            f"--nproc_per_node must be >= 1 and divide --processes ({args.processes}), "
            f"got {args.nproc_per_node}"
        )
    node = ["-node"] if args.nproc_per_node > 1 else []
    args.configs = (["ddp"] if args.ddp else []) + [f"ps-{m}{n}" for m in modes for n in ["", *node]]
    if not args.configs:
        p.error("nothing to run")
    if args.py_spy and shutil.which("py-spy") is None:
        p.error("--py-spy needs py-spy on PATH (pip install py-spy)")
    quick = args.quick

    def pick(value, quick_default, default):
        return value if value is not None else (quick_default if quick else default)

    args.runs = pick(args.runs, 1, 5)
    args.timeout = pick(args.timeout, 120.0, 600.0)
    args.spec = Spec(
        sizes=QUICK_SIZES if quick else Spec.sizes,
        batch=32 if quick else 256,
        steps=pick(args.steps, 5, 20),
        warmup=pick(args.warmup, 1, 3),
        timeout=args.timeout,
    )
    if args.runs < 1 or args.spec.steps < 1 or args.spec.warmup < 0 or args.timeout <= 0:
        p.error("--runs and --steps must be >= 1, --warmup >= 0, --timeout > 0")
    return args


def py_spy_prefix(outdir: str, tag: str, options: str) -> List[str]:
    """A py-spy command that records the wrapped worker into ``outdir/<tag>-{name}.txt``."""
    return [
        "py-spy",
        "record",
        *shlex.split(options),
        "--format",
        "raw",
        "--output",
        os.path.join(outdir, f"{tag}-{{name}}.txt"),
        "--",
    ]


def run_one(config: str, rnd: int, args, workdir: str) -> dict:
    """One run of ``config`` in round ``rnd``; its figures.

    Also measures ``other_load``: the CPU cores, averaged over the run (start-up
    included), that were busy with something other than this benchmark or
    stolen by the hypervisor; a noise indicator for a shared machine.
    """
    with OtherLoad() as load:
        row = _run_config(config, rnd, args, workdir)
    row["other_load"] = load.cores
    return row


def _run_config(config: str, rnd: int, args, workdir: str) -> dict:
    """Start the processes of one ``config`` run and summarize what they report."""
    spec = args.spec
    if config == "ddp":
        workers, servers = run_ddp(spec, workdir, args.timeout, args.processes)
    else:
        spec = Spec(**{**spec.__dict__, "sync_mode": config.startswith("ps-sync")})
        prefix = py_spy_prefix(args.py_spy, f"{rnd}-{config}", args.py_spy_args) if args.py_spy else ()
        per_node = args.nproc_per_node if config.endswith("-node") else 1
        workers, servers = run_ps(spec, workdir, args.timeout, args.processes, per_node, prefix)
    return {"round": rnd, **summarize(config, spec, workers, servers, args.nproc_per_node)}


def main(argv=None) -> int:
    args = parse_args(argv)
    stop_on_signals()
    if args.py_spy:
        os.makedirs(args.py_spy, exist_ok=True)
    logdir = args.logdir or tempfile.mkdtemp(prefix="bench_dense-")
    spec = args.spec
    print(
        f"MLP {'-'.join(map(str, spec.sizes))}: {param_bytes(spec.sizes) / 1e6:.1f} MB float32; "
        f"batch {spec.batch}/worker, {args.processes} worker processes (nodes of "
        f"{args.nproc_per_node}), {PSERVERS} pservers, {spec.warmup} warmup + {spec.steps} "
        f"timed steps, {args.runs} runs of {', '.join(args.configs)}",
        flush=True,
    )
    rows: List[dict] = []
    ok = False
    try:
        for rnd in range(args.runs):
            k = rnd % len(args.configs)
            for config in args.configs[k:] + args.configs[:k]:
                workdir = os.path.join(logdir, f"{rnd}-{config}")
                os.makedirs(workdir, exist_ok=True)
                row = run_one(config, rnd, args, workdir)
                rows.append(row)
                extra = (
                    f", {row['gbps']:.3f} GB/s push+pull per process, "
                    f"{row['mb_pushed_node']:.1f} MB pushed per node"
                    if "gbps" in row
                    else ""
                )
                print(
                    f"  round {rnd} {config:13s} {row['samples_s']:8.0f} samples/s "
                    f"(compute {row['compute_ms']:.0f} ms, update {row['update_ms']:.0f} ms "
                    f"per step{extra}; other load {row['other_load']:.2f} cores)",
                    flush=True,
                )
        ok = True
    except RunFailed as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; all child processes stopped", file=sys.stderr)
        return 130
    finally:
        if args.json and rows:
            with open(args.json, "w") as f:
                json.dump({"spec": spec.__dict__, "configs": args.configs, "runs": rows}, f, indent=1)
        if ok and not args.logdir:
            shutil.rmtree(logdir, ignore_errors=True)
        elif not ok:
            print(f"worker logs kept in {logdir}", file=sys.stderr)
    print()
    print(tables(rows, args.configs, args.processes, args.nproc_per_node, PSERVERS))
    worst = loss_check(rows)
    if worst:
        print()
    for config, diff in worst.items():
        print(
            f"loss check: per-step losses of {config} and DDP (same global rank) differ by at most {diff:.2e}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
