"""A table that lives for months: an endless id stream with admission + eviction on and off.

    python -m benchmarks.bench_lifecycle [--steps 6000] [--rounds 2] [--out FILE.json]

One pserver process and one trainer process (sync) train a CTR-like model (one
EmbeddingBag table, dim 8, sgd) on a stream whose distinct ids grow without
bound: each step has ``--batch`` bags of ``--bag`` ids, half drawn from a fixed
hot set (Zipf over 2M ids: the popular items that stay) and half from a moving
window of new ids (``--new`` fresh ids per step, each seen a few times over a
few steps and then never again: the long tail). Over 6,000 steps that is
about 64M distinct ids.

Configurations, alternating per round:

- ``off``: today's behaviour; every id gets a row on its first gradient and keeps it.
- ``on``: ``admit_count=2`` (an id needs gradients in 2 steps; counts halved every 100 steps,
  a 4 x 2**22 sketch), ``evict_unseen_steps=500``, sweeps every 50 steps.

``--sketch`` instead measures the admission sketch's false admissions on the same stream (one
shard, in process, exact counts kept for a 1/64 sample of ids) for three widths, with and
without decay.

Every second the harness samples the pserver's RSS (/proc) and its stored rows
(the Stats RPC); the trainer reports steps/s over the timed steps. Prints a
markdown table (medians over rounds) and writes the samples to ``--out`` for
the chart (``--plot --out FILE.json`` draws ``FILE.png`` beside it, from its samples).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from benchmarks.common.paths import dated_result
from harness.paths import pythonpath_with_repo

CONFIGS = {
    "off": None,
    "on": {
        "admit_count": 2,
        "admit_decay_steps": 100,
        "admit_sketch_width": 1 << 22,
        "evict_unseen_steps": 500,
        "sweep_every_steps": 50,
    },
}
DIM = 8
HOT = 2_000_000
_SCRAMBLE = np.uint64(0x9E3779B97F4A7C15)


def program(config: str):
    import torch
    from torch import nn

    from transpiler import Program

    class CTR(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.EmbeddingBag(1 << 20, DIM, mode="sum", sparse=True)
            self.head = nn.Linear(DIM, 1)

        def forward(self, ids):
            return self.head(self.emb(ids)).squeeze(1)

    torch.manual_seed(0)
    rules = CONFIGS[config]
    tables = {"emb": {"optimizer": "sgd", "optimizer_kwargs": {"lr": 0.05}, "lifecycle": rules}}
    return Program(CTR(), "sgd", lr=0.05, distributed_tables=tables)


def transpile(config: str, endpoint: str):
    from transpiler import DistributeTranspiler

    t = DistributeTranspiler()
    t.transpile(0, program=program(config), pservers=endpoint, trainers=1, sync_mode=True)
    return t


def stream(step: int, batch: int, bag: int, new: int, rng: np.random.Generator, seen=None) -> np.ndarray:
    """The ids of ``step``: (batch, bag) int64, half hot (Zipf), half from the window of new ids.

    ``seen`` (a bool array over [0, HOT + steps * new)) marks the ids drawn, to count distinct ids.
    """
    n = batch * bag
    hot = (rng.zipf(1.2, size=n // 2) - 1) % HOT
    # Ages of window ids: geometric, mean 2 steps' worth of new ids: each is seen ~2 times, then gone.
    age = rng.geometric(1.0 / (2 * new), size=n - n // 2) - 1
    fresh = HOT + step * new + new - 1 - age
    if seen is not None:
        seen[hot] = True
        seen[fresh[fresh >= 0]] = True
    ids = np.concatenate([hot, fresh]).astype(np.uint64)
    with np.errstate(over="ignore"):
        ids = (ids * _SCRAMBLE).view(np.int64)  # arbitrary-looking int64 ids
    return rng.permutation(ids).reshape(batch, bag)


def run_pserver(args) -> int:
    from pserver import ParameterServer

    t = transpile(args.config, args.endpoint)
    prog = t.get_pserver_program(args.endpoint)
    ParameterServer(prog, t.get_startup_program(args.endpoint, prog)).serve()
    return 0


def run_trainer(args) -> int:
    import torch

    from trainer import Trainer

    t = transpile(args.config, args.endpoint)
    rng = np.random.default_rng(1)
    seen = np.zeros(HOT + (args.steps + 1) * args.new, dtype=bool)
    with Trainer(t.get_trainer_program()) as tr:
        started = None
        for step in range(args.steps):
            if step == args.warmup:
                started = time.perf_counter()
            ids = torch.from_numpy(stream(step, args.batch, args.bag, args.new, rng, seen))
            y = torch.from_numpy((rng.random(args.batch) < 0.2).astype(np.float32))
            torch.nn.functional.binary_cross_entropy_with_logits(tr.model(ids), y).backward()
            tr.step()
        wall = time.perf_counter() - started
    print(
        json.dumps(
            {
                "distinct_ids": int(seen.sum()),
                "steps_s": (args.steps - args.warmup) / wall,
                "ids_s": (args.steps - args.warmup) * args.batch * args.bag / wall,
            }
        ),
        flush=True,
    )
    return 0


def sketch_accuracy(args) -> int:
    """False admissions of the count-min sketch on this stream, by width and decay (one shard, in process).

    Exact counts are kept for a 1/64 sample of ids (by id); a sampled id admitted while its true
    count of steps is below ``admit_count`` is a false admission. Prints a markdown table.
    """
    from pserver.tables.lifecycle.admission import Admission
    from transpiler.lifecycle import TableLifecycle

    print(
        "| sketch width (x4 rows) | admit_decay_steps | ids pushed | admitted | false admissions "
        "| of the ids seen once |"
    )
    print("|---|---|---|---|---|---|")
    for width in (1 << 18, 1 << 20, 1 << 22):
        for decay in (0, 100):
            lc = TableLifecycle(admit_count=2, admit_sketch_width=width, admit_decay_steps=decay)
            adm = Admission(lc, seed=1)
            rng = np.random.default_rng(1)
            exact, pushed, admitted, false = {}, 0, 0, 0
            held = set()
            for step in range(args.sketch_steps):
                ids = np.unique(stream(step, args.batch, args.bag, args.new, rng))
                pending = ids[np.fromiter((i not in held for i in ids.tolist()), bool, ids.size)]
                ok = adm.admit(pending)
                pushed += pending.size
                admitted += int(ok.sum())
                held.update(pending[ok].tolist())
                in_sample = pending % 64 == 0
                for i, a in zip(pending[in_sample].tolist(), ok[in_sample].tolist()):
                    c = exact.get(i, 0) + 1
                    exact[i] = c
                    false += a and c < lc.admit_count
                adm.end_step(step + 1)
                if decay and (step + 1) % decay == 0:
                    exact = {i: c // 2 for i, c in exact.items()}
            once = sum(1 for c in exact.values() if c <= 1) or 1
            print(
                f"| 2^{width.bit_length() - 1} | {decay or '-'} | {pushed:,} | {admitted:,} | "
                f"{false:,} of {len(exact):,} sampled | {false / once:.2%} |",
                flush=True,
            )
    return 0


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def stored_rows(endpoint: str) -> int:
    import grpc

    from psproto import ps_pb2, ps_pb2_grpc

    with grpc.insecure_channel(endpoint) as ch:
        return int(ps_pb2_grpc.ParameterServerStub(ch).Stats(ps_pb2.StatsRequest(), timeout=5).table_rows)


def one_run(config: str, args, port: int) -> dict:
    """One pserver + one trainer of ``config``; RSS and rows sampled every second."""
    endpoint = f"127.0.0.1:{port}"
    base = [
        sys.executable,
        "-m",
        "benchmarks.bench_lifecycle",
        "--config",
        config,
        "--endpoint",
        endpoint,
        "--steps",
        str(args.steps),
        "--batch",
        str(args.batch),
        "--bag",
        str(args.bag),
        "--new",
        str(args.new),
        "--warmup",
        str(args.warmup),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath_with_repo())
    ps = subprocess.Popen(base + ["--role", "pserver"], env=env, stderr=subprocess.DEVNULL)
    tr = subprocess.Popen(base + ["--role", "trainer"], env=env, stdout=subprocess.PIPE, text=True)
    samples, t0 = [], time.monotonic()
    try:
        while tr.poll() is None:
            time.sleep(1.0)
            try:
                samples.append((time.monotonic() - t0, rss_bytes(ps.pid), stored_rows(endpoint)))
            except Exception:  # not serving yet, or already gone
                pass
        out = tr.stdout.read()
        if tr.returncode != 0:
            raise RuntimeError(f"trainer of {config} failed ({tr.returncode})")
        ps.wait(60)
    finally:
        for p in (tr, ps):
            if p.poll() is None:
                p.kill()
                p.wait()
    result = json.loads(out.strip().splitlines()[-1])
    if not samples:  # the run ended before the first sample: no peak to report, and saying so beats a crash
        raise RuntimeError(
            f"{config}: the run ended within {time.monotonic() - t0:.1f} s, before the first "
            f"one-second sample of the pserver; give it more --steps"
        )
    result.update(
        config=config, samples=samples, peak_rss=max(s[1] for s in samples), final_rows=samples[-1][2]
    )
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--role",
        choices=["harness", "pserver", "trainer"],
        default="harness",
        help="harness (default) runs the benchmark; pserver and trainer are the processes it starts",
    )
    p.add_argument(
        "--config", choices=sorted(CONFIGS), default="on", help="pserver/trainer: the table's rules"
    )
    p.add_argument("--endpoint", default="", help="pserver/trainer: the pserver's address")
    p.add_argument("--steps", type=int, default=6000, help="training steps (default %(default)s)")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps first (default %(default)s)")
    p.add_argument("--batch", type=int, default=4096, help="bags per step (default %(default)s)")
    p.add_argument("--bag", type=int, default=8, help="ids per bag (default %(default)s)")
    p.add_argument("--new", type=int, default=16384, help="fresh ids per step (default %(default)s)")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds (default %(default)s)")
    p.add_argument("--configs", default="on,off", help="which configurations to run (default: on,off)")
    p.add_argument("--port", type=int, default=47311, help="the pserver's port (default %(default)s)")
    p.add_argument(
        "--out",
        default=dated_result("lifecycle"),
        help="the samples, for --plot (default %(default)s)",
    )
    p.add_argument("--plot", action="store_true", help="draw --out's chart beside it (.png) and exit")
    p.add_argument("--sketch", action="store_true", help="measure the sketch's false admissions and exit")
    p.add_argument(
        "--sketch_steps", type=int, default=600, help="--sketch: steps of the stream (default %(default)s)"
    )
    args = p.parse_args(argv)
    if args.role == "pserver":
        return run_pserver(args)
    if args.role == "trainer":
        return run_trainer(args)
    if args.plot:
        return plot(args.out)
    if args.sketch:
        return sketch_accuracy(args)
    runs = []
    for r in range(args.rounds):
        order = [c for c in ("on", "off") if c in args.configs.split(",")]
        for config in order if r % 2 == 0 else order[::-1]:
            res = one_run(config, args, args.port)
            runs.append(res)
            print(
                f"round {r} {config}: {res['steps_s']:.1f} steps/s, {res['ids_s'] / 1e6:.2f}M ids/s, "
                f"{res['distinct_ids'] / 1e6:.1f}M distinct ids, "
                f"peak RSS {res['peak_rss'] / 2**30:.2f} GiB, rows {res['final_rows']:,}",
                flush=True,
            )
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "runs": runs}, f)
    print(
        f"\n{args.steps} steps x {args.batch * args.bag:,} ids (half hot, half from a window moving by "
        f"{args.new:,} new ids per step; 'off' keeps a row for every distinct id pushed), nproc "
        f"{os.cpu_count()}, medians of {args.rounds} rounds\n"
    )
    print("| config | steps/s | M ids/s | peak pserver RSS | rows at the end |")
    print("|---|---|---|---|---|")
    for config in CONFIGS:
        mine = [r for r in runs if r["config"] == config]
        if not mine:
            continue
        print(
            f"| {config} | {statistics.median(r['steps_s'] for r in mine):.1f} | "
            f"{statistics.median(r['ids_s'] for r in mine) / 1e6:.2f} | "
            f"{statistics.median(r['peak_rss'] for r in mine) / 2**30:.2f} GiB | "
            f"{int(statistics.median(r['final_rows'] for r in mine)):,} |"
        )
    ratios = [
        on["steps_s"] / off["steps_s"]
        for on, off in zip(
            [r for r in runs if r["config"] == "on"], [r for r in runs if r["config"] == "off"]
        )
    ]
    if ratios:
        print(f"\non / off throughput per round: {', '.join(f'{x:.2f}' for x in ratios)}")
    return 0


def plot(path: str) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        data = json.load(f)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    seen = set()
    for r in data["runs"]:
        if r["config"] in seen:
            continue
        seen.add(r["config"])
        t = [s[0] for s in r["samples"]]
        label = "admission + eviction on" if r["config"] == "on" else "off (rows kept forever)"
        a.plot(t, [s[1] / 2**30 for s in r["samples"]], label=label)
        b.plot(t, [s[2] / 1e6 for s in r["samples"]], label=label)
    a.set(xlabel="seconds", ylabel="pserver RSS (GiB)", title="pserver memory")
    b.set(xlabel="seconds", ylabel="stored rows (millions)", title="stored rows")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    out = os.path.splitext(os.path.abspath(path))[0] + ".png"
    fig.savefig(out, dpi=110)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
