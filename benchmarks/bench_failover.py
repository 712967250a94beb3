"""Failover time: the longest training step while a pserver process is SIGKILLed, over many kills.

    python -m benchmarks.bench_failover [--kills 20] [--baseline_kills 5]

Runs ``benchmarks/jobs/failover_job.py`` (2 pservers x 2 trainers, sync) through
``ps-launch --max_restarts``, which starts every killed process again:

- **hot standby**: ``--server_replicas 2`` with an etcd started here (its own process and data
  directory, loopback, ``--heartbeat-interval 50 --election-timeout 500`` so that a 1 s lease is
  1 s). ``--kills`` times: wait until both shards have an in-sync backup, SIGKILL the primary of
  shard ``i % 2`` (found with the Lead call), note the time. The job goes on; the killed process
  comes back as the backup.
- **checkpoint restart** (what a job without replicas does today): ``--checkpoint_dir``, a
  checkpoint every 20 steps; ``--baseline_kills`` times: SIGKILL pserver ``i % 2``; ps-launch
  starts it again, it resumes from its checkpoint and the trainers roll back to it.

For each kill, the longest step (a trainer's whole iteration, failover_job.py's step log) that was
in flight at the kill or started after it (within 30 s, and before the next kill) is the stall the
user saw; the report gives
their distribution (median, 95th percentile, max) and the median step of the whole run.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

import grpc

from benchmarks.common.machine import cpu_model
from benchmarks.common.paths import REPO, job_script
from harness.etcd import start_etcd
from harness.paths import pythonpath_with_repo
from psproto import ps_pb2, ps_pb2_grpc

JOB = job_script("failover_job")
WINDOW = 30.0  # seconds after a kill in which a step counts as stalled by it


def ask(endpoint: str, method: str, request, timeout: float):
    """One unary call to the process at ``endpoint``; its answer, or None when it does not answer."""
    with grpc.insecure_channel(endpoint) as ch:
        try:
            return getattr(ps_pb2_grpc.ParameterServerStub(ch), method)(request, timeout=timeout)
        except grpc.RpcError:
            return None


def lead(endpoint: str) -> Optional[ps_pb2.LeadReply]:
    return ask(endpoint, "Lead", ps_pb2.LeadRequest(), 1.0)


def stats(endpoint: str) -> Optional[ps_pb2.StatsReply]:
    return ask(endpoint, "Stats", ps_pb2.StatsRequest(), 2.0)


def roles(log_dir: str) -> List[dict]:
    try:
        with open(os.path.join(log_dir, "roles.json")) as f:
            return json.load(f)["roles"]
    except (OSError, ValueError):
        return []


def wait(predicate, what: str, timeout: float = 120.0, launcher: Optional[subprocess.Popen] = None):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if launcher is not None and launcher.poll() is not None:
            raise RuntimeError(f"ps-launch exited ({launcher.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def shard_primary_in_sync(groups: List[List[str]], shard: int) -> Optional[str]:
    """The endpoint of ``shard``'s primary once its backup is in sync, else None."""
    for ep in groups[shard]:
        answer = lead(ep)
        if answer is not None and answer.role == "primary":
            s = stats(ep)
            return ep if s is not None and s.replica.backup_in_sync else None
    return None


def pid_of(log_dir: str, endpoint: str) -> Optional[int]:
    for r in roles(log_dir):
        if r.get("endpoint") == endpoint and r.get("returncode") is None:
            return r["pid"]
    return None


def launch(work: str, name: str, extra: List[str], job_args: List[str]) -> Tuple[subprocess.Popen, str, str]:
    log_dir, out = os.path.join(work, name, "log"), os.path.join(work, name, "out")
    os.makedirs(out)
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
        "--max_restarts",
        "100",
        "--show",
        "none",
        *extra,
        JOB,
        "--out_dir",
        out,
        *job_args,
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=open(os.path.join(work, name, "launch.log"), "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": pythonpath_with_repo()},
    )
    return proc, log_dir, out


def finish(proc: subprocess.Popen, out: str) -> None:
    open(os.path.join(out, "stop"), "w").close()
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def steps(out: str) -> List[Tuple[float, float]]:
    rows = []
    for path in glob.glob(os.path.join(out, "steps-*.jsonl")):
        with open(path) as f:
            rows += [(r["start"], r["end"]) for r in map(json.loads, f)]
    return rows


def stalls(rows: List[Tuple[float, float]], kills: List[float]) -> List[float]:
    """Per kill, the longest step in flight at it or started after it, within WINDOW s and before the next
    kill."""
    ends = [min(t + WINDOW, nxt) for t, nxt in zip(kills, kills[1:] + [float("inf")])]
    return [
        max((end - start for start, end in rows if end >= t and start < until), default=float("nan"))
        for t, until in zip(kills, ends)
    ]


def quantile(values: List[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run_replicated(work: str, url: str, kills: int, job_args: List[str]) -> Tuple[List[float], List[Tuple]]:
    proc, log_dir, out = launch(
        work, "replicated", ["--server_replicas", "2", "--coordinator", url], job_args
    )
    try:
        wait(lambda: len(roles(log_dir)) >= 6, "the roles", launcher=proc)
        eps = [r["endpoint"] for r in roles(log_dir) if r["kind"] == "PSERVER"]
        groups = [[eps[0], eps[2]], [eps[1], eps[3]]]
        times = []
        for i in range(kills):
            shard = i % 2
            for k in (0, 1):
                wait(lambda k=k: shard_primary_in_sync(groups, k), f"shard {k} in sync", launcher=proc)
            primary = shard_primary_in_sync(groups, shard)
            time.sleep(0.5)  # a few steps of steady training before the kill
            pid = pid_of(log_dir, primary)
            times.append(time.time())
            os.kill(pid, signal.SIGKILL)
            print(f"  kill {i + 1}/{kills}: primary of shard {shard} at {primary} (pid {pid})", flush=True)
        for k in (0, 1):
            wait(lambda k=k: shard_primary_in_sync(groups, k), f"shard {k} in sync", launcher=proc)
        time.sleep(2.0)
    finally:
        finish(proc, out)
    return times, steps(out)


def run_checkpoint(work: str, kills: int, job_args: List[str]) -> Tuple[List[float], List[Tuple]]:
    ckpt = os.path.join(work, "ckpt")
    proc, log_dir, out = launch(work, "checkpoint", [], job_args + ["--checkpoint_dir", ckpt])
    try:
        wait(lambda: len(roles(log_dir)) >= 4, "the roles", launcher=proc)
        eps = [r["endpoint"] for r in roles(log_dir) if r["kind"] == "PSERVER"]
        times = []
        for i in range(kills):
            wait(
                lambda: len(steps(out)) > 0 and time.time() - max(e for _, e in steps(out)) < 0.5,
                "training to run",
                launcher=proc,
            )
            time.sleep(3.0)  # past the next checkpoint, and steady again after the last recovery
            pid = pid_of(log_dir, eps[i % 2])
            times.append(time.time())
            os.kill(pid, signal.SIGKILL)
            print(f"  kill {i + 1}/{kills}: pserver {i % 2} (pid {pid})", flush=True)
            wait(lambda: max(e for _, e in steps(out)) > times[-1] + 1.0, "training again", launcher=proc)
        time.sleep(2.0)
    finally:
        finish(proc, out)
    return times, steps(out)


def summary(name: str, kills: List[float], rows) -> Dict[str, float]:
    s = stalls(rows, kills)
    # Every step of the run: the few stalled ones do not move the median.
    return {
        "name": name,
        "kills": len(kills),
        "median": statistics.median(s),
        "p95": quantile(s, 0.95),
        "max": max(s),
        "calm_step": statistics.median(end - start for start, end in rows),
        "stalls": s,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--kills", type=int, default=20, help="SIGKILLs of a primary with hot standby (default %(default)s)"
    )
    p.add_argument(
        "--baseline_kills",
        type=int,
        default=5,
        help="SIGKILLs of a pserver restarted from its checkpoint; 0 skips them (default %(default)s)",
    )
    p.add_argument(
        "--step_delay",
        type=float,
        default=0.02,
        help="seconds between a trainer's steps (failover_job.py; default %(default)s)",
    )
    p.add_argument("--json", help="write the figures here too")
    args = p.parse_args(argv)
    if shutil.which("etcd") is None:
        print("bench_failover: etcd is not installed (apt-get install etcd-server)", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="bench-failover-")
    job_args = ["--step_delay", str(args.step_delay)]
    with start_etcd(work) as etcd:
        print(f"hot standby: {args.kills} kills of a primary", flush=True)
        rep = summary(
            "hot standby (server_replicas=2)", *run_replicated(work, etcd.url, args.kills, job_args)
        )
        results = [rep]
        if args.baseline_kills:
            print(f"checkpoint restart: {args.baseline_kills} kills of a pserver", flush=True)
            results.append(
                summary(
                    "checkpoint restart (no replicas)", *run_checkpoint(work, args.baseline_kills, job_args)
                )
            )
    cpu = cpu_model()
    print(
        f"\nfailover_job.py, sync, 2 pservers x 2 trainers, {os.cpu_count()} cores ({cpu}), work dir {work}\n"
    )
    print("| recovery | kills | longest step per kill: median | p95 | max | median step of the run |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['name']} | {r['kills']} | {r['median']:.2f} s | {r['p95']:.2f} s | {r['max']:.2f} s | "
            f"{r['calm_step'] * 1000:.1f} ms |"
        )
    print(
        "\nstalls (s): "
        + "; ".join(f"{r['name']}: " + ", ".join(f"{x:.2f}" for x in r["stalls"]) for r in results)
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
