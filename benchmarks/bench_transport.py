"""Transport alone: push+pull GB/s of one trainer against pserver processes, no compute.

    python -m benchmarks.bench_transport [--pservers 2] [--chunk_bytes 1048576] [--steps 15] [--runs 3]
                                         [--sizes 512,2048,2048,2048,10]

The model is the dense benchmark's 38 MB MLP (512-2048-2048-2048-10) unless ``--sizes`` says
otherwise (a tiny one, e.g. ``16,16,2``, measures the per-call cost instead of bytes), SGD;
gradients are zeros so parameters stay put. Each run starts fresh pserver
processes on loopback, times ``Trainer.step()`` (push every block, pull every
block) and reports the median step and the resulting push+pull GB/s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

from benchmarks.jobs.dense_workers import build_model
from harness.paths import pythonpath_with_repo
from harness.ports import free_ports
from transpiler import DistributeTranspiler, DistributeTranspilerConfig, Program

SIZES = (512, 2048, 2048, 2048, 10)


def transpiler(endpoints, chunk_bytes, sizes=SIZES):
    t = DistributeTranspiler(DistributeTranspilerConfig(chunk_bytes=chunk_bytes))
    t.transpile(0, program=Program(build_model(sizes, 0), "sgd", lr=0.01), pservers=endpoints, trainers=1)
    return t


def serve(endpoint, endpoints, chunk_bytes, sizes):
    """Pserver role (run in a child process)."""
    from pserver import ParameterServer

    t = transpiler(endpoints, chunk_bytes, sizes)
    prog = t.get_pserver_program(endpoint)
    ParameterServer(prog, t.get_startup_program(endpoint, prog)).serve()


def one_run(n_pservers, chunk_bytes, steps, sizes=SIZES):
    """Median step time (s) and model bytes of one run against fresh pservers."""
    from trainer import Trainer

    endpoints = [f"127.0.0.1:{p}" for p in free_ports(n_pservers)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.bench_transport",
                "--serve",
                ep,
                "--endpoints",
                ",".join(endpoints),
                "--chunk_bytes",
                str(chunk_bytes),
                "--sizes",
                ",".join(map(str, sizes)),
            ],
            stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": pythonpath_with_repo()},
        )
        for ep in endpoints
    ]
    try:
        with Trainer(transpiler(endpoints, chunk_bytes, sizes).get_trainer_program()) as tr:
            params = list(tr.model.parameters())
            times = []
            for i in range(steps + 3):
                for p in params:
                    p.grad = torch.zeros_like(p)
                start = time.perf_counter()
                tr.step()
                if i >= 3:
                    times.append(time.perf_counter() - start)
        for p in procs:
            p.wait(30)
        return statistics.median(times), sum(p.numel() * p.element_size() for p in params)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pservers", type=int, default=2, help="pserver processes (default %(default)s)")
    ap.add_argument(
        "--chunk_bytes",
        type=int,
        default=1 << 20,
        help="DistributeTranspilerConfig.chunk_bytes (default %(default)s)",
    )
    ap.add_argument(
        "--steps", type=int, default=15, help="timed steps per run, after 3 untimed (default %(default)s)"
    )
    ap.add_argument(
        "--runs", type=int, default=3, help="runs, each against fresh pservers (default %(default)s)"
    )
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="MLP layer widths")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--endpoints", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sizes = tuple(int(w) for w in args.sizes.split(","))
    if args.serve:
        serve(args.serve, args.endpoints, args.chunk_bytes, sizes)
        return 0
    torch.set_num_threads(1)
    for run in range(args.runs):
        step, nbytes = one_run(args.pservers, args.chunk_bytes, args.steps, sizes)
        print(
            f"run {run}: {args.pservers} pservers, chunk {args.chunk_bytes}: median step "
            f"{step * 1000:.1f} ms, push+pull {2 * nbytes / step / 1e9:.2f} GB/s",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
