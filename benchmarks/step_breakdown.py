"""Where a job S step's time goes: this project's trainer and pserver, and TorchRec, phase by phase.

    python -m benchmarks.step_breakdown [--systems ours-async,ours-sync,torchrec] [--window 10]

Each system runs job S (``shared/peers/jobs.py``) long enough to sample a steady window:

- **this project** (2 pservers x 2 trainers through ``ps-launch``, ``jobs/job_s.py``, the README's loop):
  the trainers time their own steps (``job_s.py``'s ``forward_ms`` (of which the table's ``lookup_ms``),
  ``backward_ms`` and ``step_ms``, wall clock per step, averaged over both trainers and every timed step;
  and their CPU per step: the process's, the main thread's in forward and backward, and the rest:
  ``tr.step()``'s encoding, decoding and bookkeeping, the feed's thread); the pservers time the CPU of each
  phase of a push in the handler's thread (``jobs/instruments.PserverPhases``: decode, apply, read the
  blocks, look up the next batch's rows, checks and encoding) and their whole process, over the same steps.
- **TorchRec** (``torchrec_ctr.py`` in its venv, 2 ranks): the CPU of rank 0 over the window and py-spy's
  samples of it, split into the embedding's forward (input and output all-to-alls and the fbgemm lookup),
  the rest of the forward (MLP), backward (with the rows' SGD fused into it), the dense optimizer step, and
  the rest; per step = CPU of the window / steps in it.

TorchRec needs py-spy (``pip install py-spy``), allowed to read other processes (root, or ``ptrace_scope``
0). Prints a table in Markdown; ``--json`` appends every figure.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Sequence, Tuple

from benchmarks.common.paths import DEFAULT_PEERS, REPO, job_script
from benchmarks.common.peer_runners import job_s_results, role_results
from harness.paths import pythonpath_with_repo

TICKS = os.sysconf("SC_CLK_TCK")

# py-spy's samples of a TorchRec rank by phase: the first rule with a substring in a frame of the stack wins.
TORCHREC_PHASES: Sequence[Tuple[str, Tuple[str, ...]]] = (
    ("backward (rows' SGD fused in)", ("backward",)),
    (
        "dense optimizer step",
        ("CombinedOptimizer.step", "KeyedOptimizerWrapper.step", "SGD.step", "_single_tensor_sgd"),
    ),
    (
        "forward: MLP and loss",
        ("Sequential.forward", "Linear.forward", "ReLU.forward", "BCEWithLogitsLoss", "binary_cross_entropy"),
    ),
    ("forward: embedding (all-to-alls + fbgemm lookup)", ("torchrec/", "fbgemm")),
    ("building the batch (KeyedJaggedTensor)", ("_kjt",)),
)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def py_spy(pid: int, seconds: float, rate: int, out: str) -> List[Tuple[List[str], int]]:
    """py-spy's raw samples of ``pid`` for ``seconds``: (frames root first, count) per distinct stack."""
    cmd = [
        "py-spy",
        "record",
        "--pid",
        str(pid),
        "--rate",
        str(rate),
        "--duration",
        str(int(seconds)),
        "--format",
        "raw",
        "--output",
        out,
        "--nonblocking",
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=seconds + 60)
    samples = []
    with open(out) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            samples.append((stack.split(";"), int(n)))
    return samples


def phases(samples, rules, rest: str = "other") -> Dict[str, int]:
    """Samples per phase: the first rule with a substring in any frame of a stack takes it."""
    out: Dict[str, int] = collections.Counter()
    for frames, n in samples:
        joined = ";".join(frames)
        out[next((name for name, keys in rules if any(k in joined for k in keys)), rest)] += n
    return out


def run_ours(args, sync: bool, workdir: str) -> dict:
    """Job S on this project: the trainers' and the pservers' own timers (job_s.py)."""
    log_dir = os.path.join(workdir, "log")
    cmd = [
        sys.executable,
        "-m",
        "trainer.launch",
        "--server_num",
        "2",
        "--worker_num",
        "2",
        "--log_dir",
        log_dir,
        job_script("job_s"),
        "--peers",
        args.peers,
        "--steps",
        str(args.steps),
        "--eval_examples",
        "2000",
    ]
    if not sync:
        cmd.append("--async")
    done = subprocess.run(
        cmd,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        timeout=args.timeout,
        env={
            **os.environ,
            "PYTHONPATH": pythonpath_with_repo(),
            "PS_BENCH_PHASES": "0" if args.no_phases else "1",
        },
    )
    if done.returncode != 0:
        raise RuntimeError(f"ps-launch exited {done.returncode}; logs in {log_dir}")
    res = job_s_results(log_dir, 2)
    mean = lambda k: sum(r[k] for r in res) / len(res)  # noqa: E731
    servers = role_results(log_dir, "serverlog", 2, prefix="PSERVER_PHASES ")
    phases_ms = {
        k: sum(s["phases_ms_per_push"][k] for s in servers) / 2 for k in servers[0]["phases_ms_per_push"]
    }  # empty with --no-phases
    return {
        "system": f"ours-{'sync' if sync else 'async'}",
        "examples_s": sum(r["examples"] for r in res)
        / (max(r["end"] for r in res) - min(r["start"] for r in res)),
        "trainer_ms": {
            "forward": mean("forward_ms"),
            "lookup": mean("lookup_ms"),
            "backward": mean("backward_ms"),
            "step": mean("step_ms"),
        },
        # CPU per step: the trainer's process, its main thread in forward + backward, and the rest.
        "trainer_cpu_ms": {
            "process": mean("cpu_ms"),
            "forward + backward": mean("fwd_bwd_cpu_ms"),
            "outside forward and backward": mean("cpu_ms") - mean("fwd_bwd_cpu_ms"),
        },
        "pserver_cpu_ms_per_push": sum(s["process_ms_per_push"] for s in servers) / 2,
        "pserver_phases_ms_per_push": phases_ms,
    }


def run_torchrec(args, workdir: str) -> dict:
    """Job S on TorchRec; rank 0's CPU per step split by py-spy's samples."""
    script = os.path.join(args.peers, "torchrec_ctr.py")
    out_json = os.path.join(workdir, "torchrec.json")
    proc = subprocess.Popen(
        [args.torchrec_python, script, "--steps", str(args.torchrec_steps), "--json", out_json],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        cwd=workdir,
    )
    try:
        rank0 = _spawned_worker(proc.pid, 120)
        time.sleep(
            args.torchrec_settle
        )  # the ranks build their batches, then train: sample inside the timed steps
        cpu0, t0 = cpu_seconds(rank0), time.monotonic()
        samples = py_spy(rank0, args.window, args.rate, os.path.join(workdir, "torchrec0.raw"))
        cpu1, wall = cpu_seconds(rank0), time.monotonic() - t0
        code = proc.wait(timeout=args.timeout)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)
    if code != 0:
        raise RuntimeError(f"torchrec_ctr.py exited {code}")
    with open(out_json) as f:
        res = json.loads(f.read().splitlines()[-1])
    steps = wall * 1e3 / res["ms_per_step"]
    counts = phases(samples, TORCHREC_PHASES)
    cpu_ms = 1e3 * (cpu1 - cpu0) / steps
    per_step = {name: 1e3 * (n / args.rate) / steps for name, n in counts.items()}
    per_step["not in a Python frame"] = max(0.0, cpu_ms - sum(per_step.values()))
    return {
        "system": "torchrec",
        "examples_s": res["examples_per_s"],
        "ms_per_step": res["ms_per_step"],
        "rank0_cpu_ms_per_step": cpu_ms,
        "rank0_phases_ms_per_step": per_step,
        "window_s": wall,
    }


def _spawned_worker(parent: int, timeout: float) -> int:
    """The first spawned child of ``parent`` that runs torch's multiprocessing (rank 0 starts first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kids = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout.split()
        workers = []
        for k in kids:
            with open(f"/proc/{k}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    workers.append(int(k))
        if len(workers) >= 2:
            return min(workers)
        time.sleep(0.2)
    raise RuntimeError("TorchRec's ranks did not start")


def table(results: List[dict]) -> str:
    """The Markdown tables of the breakdowns."""
    lines = []
    for r in results:
        if r["system"].startswith("ours"):
            t = r["trainer_ms"]
            total = t["forward"] + t["backward"] + t["step"]
            lines += [
                f"**{r['system']}**: {r['examples_s']:,.0f} examples/s; a trainer's step, wall ms "
                "(mean of 2 trainers over the timed steps)",
                "",
                "| forward | of which the table's lookup | backward | tr.step() (push, wait, pull) | step |",
                "|---|---|---|---|---|",
                f"| {t['forward']:.2f} | {t['lookup']:.2f} | {t['backward']:.2f} | {t['step']:.2f} | "
                f"{total:.2f} |",
                "",
                "a trainer's CPU per step, ms: "
                + ", ".join(f"{k} {v:.2f}" for k, v in r["trainer_cpu_ms"].items()),
                "",
                f"pservers: {r['pserver_cpu_ms_per_push']:.2f} ms of CPU per push (mean of 2)"
                + (", by phase:" if r["pserver_phases_ms_per_push"] else " (phases not timed)"),
                "",
                "| phase | CPU ms per push |",
                "|---|---|",
            ]
            lines += [
                f"| {k} | {v:.2f} |"
                for k, v in sorted(r["pserver_phases_ms_per_push"].items(), key=lambda kv: -kv[1])
            ]
        else:
            lines += [
                f"**TorchRec**: {r['examples_s']:,.0f} examples/s, {r['ms_per_step']:.1f} ms per step; rank "
                "0 "
                f"{r['rank0_cpu_ms_per_step']:.2f} ms of CPU per step, by phase (py-spy of rank 0):",
                "",
                "| phase | CPU ms per step |",
                "|---|---|",
            ]
            lines += [
                f"| {k} | {v:.2f} |"
                for k, v in sorted(r["rank0_phases_ms_per_step"].items(), key=lambda kv: -kv[1])
            ]
        lines.append("")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--systems",
        default="ours-async,ours-sync,torchrec",
        help="comma-separated: ours-async, ours-sync, torchrec (default: %(default)s)",
    )
    p.add_argument("--peers", default=DEFAULT_PEERS, help="the peers' folder (default: %(default)s)")
    p.add_argument(
        "--torchrec-python",
        default=os.path.join(tempfile.gettempdir(), "torchrec-venv", "bin", "python"),
        help="Python of TorchRec's venv (shared/peers/setup_torchrec.sh; default: %(default)s)",
    )
    p.add_argument(
        "--steps", type=int, default=1500, help="timed steps of this project's trainers (default %(default)s)"
    )
    p.add_argument(
        "--torchrec-steps", type=int, default=2000, help="TorchRec's timed steps (default %(default)s)"
    )
    p.add_argument(
        "--torchrec-settle",
        type=float,
        default=12.0,
        help="s after TorchRec's ranks start before sampling (they build their batches first)",
    )
    p.add_argument(
        "--window", type=float, default=10.0, help="sampled seconds of TorchRec (default %(default)s)"
    )
    p.add_argument("--rate", type=int, default=200, help="py-spy samples per second (default %(default)s)")
    p.add_argument("--timeout", type=float, default=900.0, help="s a system may run (default %(default)s)")
    p.add_argument("--json", default=None, help="append the figures to this file")
    p.add_argument(
        "--no-phases",
        action="store_true",
        help="the pservers' CPU per push without the phase timers (they cost tens of µs a push)",
    )
    args = p.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    bad = set(args.systems) - {"ours-async", "ours-sync", "torchrec"}
    if bad:
        p.error(f"unknown systems {sorted(bad)}")
    if "torchrec" in args.systems and shutil.which("py-spy") is None:
        p.error("py-spy is not installed (TorchRec's breakdown samples it): pip install py-spy")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    results = []
    for system in args.systems:
        with tempfile.TemporaryDirectory(prefix="breakdown-") as workdir:
            if system == "torchrec":
                if not os.path.isfile(args.torchrec_python):
                    print(
                        f"torchrec skipped: {args.torchrec_python} does not exist (run setup_torchrec.sh)",
                        file=sys.stderr,
                    )
                    continue
                results.append(run_torchrec(args, workdir))
            else:
                results.append(run_ours(args, system == "ours-sync", workdir))
        print(f"{system} done", file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "a") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
