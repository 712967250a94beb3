"""One pserver process holding a big table (default 50M rows of dim 16, SGD) keeps serving.

Usage::

    python -m benchmarks.bench_table_serve [--rows 50000000] [--batch 1000000] [--runs 5]

Starts one real pserver process (``ps-server``, async mode, one table, no dense
parameters) on loopback, then a trainer in this process pushes sparse
gradients for ``--rows`` new ids, ``--batch`` ids per step, through the normal
``PushPull`` RPC, so every row is created on the pserver by its first update.
Then, with the table full, it measures what a training job would see: the
pserver's peak RSS (VmHWM) and ``Stats`` (rows, bytes), and the latency of
``pull_rows`` (one Prefetch round trip) for 26k ids (a CTR batch of 1024 x 26)
and 100k ids, stored and never-seen ones, median of ``--runs`` x 10 calls.
The pserver is stopped on exit, also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

import grpc
import numpy as np
import torch

from harness.paths import pythonpath_with_repo
from harness.ports import free_ports
from psproto import ps_pb2, ps_pb2_grpc
from trainer import Trainer
from transpiler import DistributeTranspiler
from transpiler.tables import initial_rows

PROGRAM = """
import torch
from torch import nn
from transpiler import Program

def build():
    return Program(nn.ModuleDict({"emb": nn.Embedding(%d, 16, sparse=True, device="meta")}), "sgd", lr=0.1,
                   distributed_tables=["emb"])
"""


def load_program(path: str):
    """The module of the program file the pserver loads (``--program FILE:build``), loaded here from its
    file."""
    spec = importlib.util.spec_from_file_location("program", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rss_peak_gib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / (1 << 20)
    return float("nan")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--rows", type=int, default=50_000_000, help="rows the table ends with (default %(default)s)"
    )
    p.add_argument("--batch", type=int, default=1_000_000, help="new ids per push")
    p.add_argument("--runs", type=int, default=5, help="runs of 10 calls per latency (default %(default)s)")
    args = p.parse_args(argv)

    workdir = tempfile.mkdtemp(prefix="bench_table_serve-")
    program_file = os.path.join(workdir, "program.py")
    with open(program_file, "w") as f:
        f.write(PROGRAM % args.rows)
    endpoint = f"127.0.0.1:{free_ports(1)[0]}"
    log_path = os.path.join(workdir, "pserver.log")
    env = {**os.environ, "PYTHONPATH": pythonpath_with_repo()}
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pserver.cli",
                "--program",
                f"{program_file}:build",
                "--endpoint",
                endpoint,
                "--pservers",
                endpoint,
                "--trainers",
                "1",
                "--sync_mode",
                "false",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        program = load_program(program_file)  # the same Program the pserver loaded

        t = DistributeTranspiler()
        t.transpile(0, program=program.build(), pservers=endpoint, trainers=1, sync_mode=False)
        tr = Trainer(t.get_trainer_program())
        spec = tr.program.tables[0]
        print(
            f"pserver {endpoint} (pid {server.pid}) up; RSS {rss_peak_gib(server.pid):.2f} GiB; "
            f"filling {args.rows:,} rows of dim {spec.dim} in pushes of {args.batch:,} new ids",
            flush=True,
        )
        rng = np.random.default_rng(0)
        ids_all = rng.permutation(args.rows).astype(np.int64) * 7919 - 2**40  # distinct, spread, negatives
        grad = torch.full((args.batch, spec.dim), 1e-3)
        start = time.perf_counter()
        for step, a in enumerate(range(0, args.rows, args.batch)):
            ids = torch.from_numpy(ids_all[a : a + args.batch])
            g = grad[: len(ids)]
            tr.channels[endpoint].push_pull(
                step, [(spec.ids_name, ids), (spec.rows_name, g)], tr.blocks.dtype_and_shape, None
            )
            if step % 10 == 9:
                print(
                    f"  {a + len(ids):>12,} rows after {time.perf_counter() - start:6.1f} s; "
                    f"pserver peak RSS {rss_peak_gib(server.pid):.2f} GiB",
                    flush=True,
                )
        fill_s = time.perf_counter() - start
        tr.state.advance(step + 1, tr.state.position)  # the pushes above went around the stepper

        with grpc.insecure_channel(endpoint) as ch:
            stats = ps_pb2_grpc.ParameterServerStub(ch).Stats(ps_pb2.StatsRequest(), timeout=30)
        peak = rss_peak_gib(server.pid)
        print(
            f"filled in {fill_s:.0f} s ({args.rows / fill_s / 1e6:.2f}M rows/s through gRPC); "
            f"Stats: {stats.table_rows:,} rows, {stats.table_bytes / stats.table_rows:.1f} bytes/row "
            f"(raw {8 + 4 * spec.dim}); pserver peak RSS {peak:.2f} GiB "
            f"({peak * (1 << 30) / stats.table_rows:.1f} B/row)",
            flush=True,
        )

        def latency(n: int, stored: bool) -> float:
            times = []
            for _ in range(args.runs * 10):
                if stored:
                    ids = ids_all[rng.integers(0, args.rows, size=n)]
                else:
                    ids = rng.integers(2**50, 2**60, size=n)
                ids = torch.from_numpy(ids)
                t0 = time.perf_counter()
                rows = tr.pull_rows("emb", ids)
                times.append(time.perf_counter() - t0)
                assert rows.shape == (n, spec.dim)
            return statistics.median(times)

        print("\n| pull_rows (one Prefetch round trip) | ms, median | rows/s |")
        print("|---|---|---|")
        for n in (26_000, 100_000):
            for stored in (True, False):
                ms = latency(n, stored) * 1e3
                print(
                    f"| {n:,} ids, {'stored' if stored else 'never seen'} | {ms:.1f} | "
                    f"{n / ms * 1e3 / 1e6:.2f}M |",
                    flush=True,
                )
        check = tr.pull_rows("emb", torch.from_numpy(ids_all[:5]))
        assert torch.allclose(check, torch.from_numpy(initial_rows(spec, ids_all[:5])) - 1e-4, atol=1e-6), (
            "rows moved wrongly"
        )
        print(
            f"\npserver still serving: {server.poll() is None}; final peak RSS "
            f"{rss_peak_gib(server.pid):.2f} GiB"
        )
        tr.close()
    finally:
        if server.poll() is None:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
