"""An emulated fan-in: K trainers (up to 1,024) in a few load-generator processes against P real pservers.

For each mode (``--modes sync,async``) and K (``--trainers 16,64,256,1024``) one run starts P pserver
processes (job S's program transpiled for K trainers: the MLP's blocks and the table's shards) and
``--load`` load-generator processes that share the K emulated trainers between them. Each emulated
trainer is a real trainer session through the trainer's own client code, with its own channel (and TCP
connection) to every pserver, its own Hello, session, heartbeat thread and Close; each of its ``--steps``
steps pushes job S-sized gradients (a batch's unique ids of 26 Zipf slots, dim-16 rows, the MLP's
dense blocks) to every pserver with the next batch's ids, as job S does
(:mod:`benchmarks.jobs.fanin_workers`). No forward or backward runs: gradients are a function of
(trainer, step) (:mod:`benchmarks.jobs.fanin_job`). In async runs ``--in_flight N`` lets at most N of a
load generator's trainers be inside a step at once (default: all of them). Real async trainers spread
their steps out with their own forward and backward; the emulated ones, with none, all push at once,
and on a small host a load generator of hundreds of trainers then starves itself
(:func:`benchmarks.jobs.fanin_workers.stepping`). Sync runs always have every trainer push at once.

Every run must complete within ``--timeout`` s, every pserver must count exactly K x steps pushes, and
none may report a dropped trainer (``StatsReply.trainers_dropped``): otherwise the benchmark fails.
In sync mode it CHECKS the applied model: after the last step trainer 0 pulls the dense blocks and the
rows of about 250 ids (one never pushed among them), and each must equal its initial value minus lr
times the sum over steps of the mean of the K pushed gradients, computed again here in float64
(within ``fanin_job.TOLERANCE``, 1e-6; the runs here stay under 1e-8).

Per (mode, K) it reports, for the window from the first push to the last answer
(``benchmarks.reports.fanin`` says exactly how each figure is measured): steps a second;
pserver CPU per push; pserver threads (the most seen); pserver resident memory at start, per idle
session, and what a sync step holds; calls a second by kind (pushes, prefetches, heartbeats) and
heartbeats per trainer per pserver per minute; the p50/p99 of a push's client-side latency and, in
sync mode, of a parked push's release (its answer after the step's last push was sent).

The pservers run with the library's defaults (``pserver_rpc_workers`` included unless
``--rpc_workers`` is given), no shared memory, on loopback; every process started is stopped.

``--kill_pserver I``: the pservers checkpoint (sync every step, async every K updates), and pserver I is
SIGKILLed once it counted half its pushes and started again (:mod:`benchmarks.common.fanin_faults`): the
run must still complete with no trainer dropped and, in sync mode, pass the model check (the trainers roll
back to the restarted pserver's checkpoint and push those steps again); it reports how long the pserver
was down and how fast the K trainers re-established their sessions. Its pushes count more than K x steps
(the steps redone), and its CPU figures include the recovery. ``--replicas``: hot standby, every shard on
two processes and an etcd started here; ``--kill_pserver I`` then kills shard I's primary (whichever
process leads it) and starts it again, to rejoin as the backup: the backup leads, and the trainers go on
with no roll-back (down: until the backup leads and answers).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile
import time
from typing import Dict, List, Sequence

import numpy as np
import torch

from benchmarks.common.fanin_faults import kill_mid_run, recovery_of, wait_for
from benchmarks.common.fanin_stats import PserverStats
from benchmarks.common.paths import REPO, dated_result
from benchmarks.common.proc_stats import Sampler, cpu_seconds, status
from benchmarks.jobs.fanin_job import JOB_S, TOLERANCE, Spec, check_ids, expected_model, transpiler
from benchmarks.jobs.fanin_workers import touch
from benchmarks.reports.fanin import markdown_table, summarise
from harness.etcd import start_etcd
from harness.paths import pythonpath_with_repo
from harness.ports import free_ports
from harness.processes import Command, RunFailed, stop_on_signals, tail

# A table row's bytes on a pserver: its int64 id, its float32 values and its int64 last step seen (the
# index aside): what the tables' growth is counted at (benchmarks.reports.fanin).
ROW_BYTES = 8 + 4 * JOB_S.S_EMB_DIM + 8

log = logging.getLogger("benchmarks.bench_fanin")


def check_alive(processes: Sequence[Command], what: str) -> None:
    """RunFailed naming the first of ``processes`` that exited, with its log's tail."""
    for c in processes:
        if c.proc.poll() is not None:
            raise RunFailed(
                f"{what}: {os.path.basename(c.log_path)[:-4]} exited with status {c.proc.returncode}; "
                f"log {c.log_path}:\n{tail(c.log_path)}"
            )


def wait_for_files(paths: Sequence[str], deadline: float, processes: Sequence[Command], what: str) -> None:
    """Return once every path exists; RunFailed if a process exits or ``deadline`` passes first."""
    while not all(os.path.exists(p) for p in paths):
        check_alive(processes, what)
        if time.monotonic() > deadline:
            missing = [os.path.basename(p) for p in paths if not os.path.exists(p)]
            raise RunFailed(f"{what}: deadline passed; still missing {missing}")
        time.sleep(0.01)


def check_dropped(stats: Dict[str, object], k: int, what: str, restarted: str = "") -> None:
    """RunFailed if a pserver dropped a trainer or does not see all ``k`` alive (the ``restarted`` one: those
    that came back to it; a trainer that had pushed all its steps before the kill has no call to make
    there until its Close)."""
    for ep, s in stats.items():
        if list(s.trainers_dropped):
            raise RunFailed(f"{what}: pserver {ep} dropped trainers {sorted(s.trainers_dropped)}")
        if len(s.trainers_alive) != k and ep != restarted:
            raise RunFailed(f"{what}: pserver {ep} sees {len(s.trainers_alive)} trainers alive, not {k}")


def check_model(spec: Spec, models: Dict[str, Dict[str, torch.Tensor]]) -> Dict[str, float]:
    """The sync check: RunFailed unless the applied model is the initial one minus lr x the mean pushed
    gradients."""
    blocks = transpiler(spec).get_trainer_program().blocks
    initial, final = models["initial"], models["final"]
    ids = check_ids(spec)
    want, want_rows = expected_model(
        spec, blocks, {b.name: initial[b.name] for b in blocks}, ids, initial["@rows"]
    )
    dense_err = max(float((final[name].double() - w).abs().max()) for name, w in want.items())
    rows_err = float((final["@rows"].double() - want_rows).abs().max())
    moved = float((final["@rows"].double() - initial["@rows"].double()).abs().max())
    if not (dense_err <= TOLERANCE and rows_err <= TOLERANCE and moved > 100 * TOLERANCE):
        raise RunFailed(
            f"sync model check failed for K={spec.trainers}: max |error| dense {dense_err:.3g}, rows "
            f"{rows_err:.3g} (tolerance {TOLERANCE:g}); rows moved at most {moved:.3g}"
        )
    return {
        "dense_max_error": dense_err,
        "rows_max_error": rows_err,
        "rows_checked": int(ids.size),
        "tolerance": TOLERANCE,
    }


def run_one(args, k: int, sync_mode: bool, work: str) -> dict:
    """One run of K emulated trainers against ``args.pservers`` pservers; its figures (see the module doc)."""
    mode = "sync" if sync_mode else "async"
    run_dir = tempfile.mkdtemp(prefix=f"fanin-{mode}-{k}-", dir=work)
    endpoints = [f"127.0.0.1:{p}" for p in free_ports(args.pservers)]
    stack = contextlib.ExitStack()  # entered below; etcd's stop is its first callback
    hot_standby = {}
    if args.replicas:
        etcd = stack.enter_context(start_etcd(run_dir))
        hot_standby = dict(
            replica_endpoints=[f"127.0.0.1:{p}" for p in free_ports(args.pservers)], coordinator=etcd.url
        )
    spec = Spec(
        trainers=k,
        pservers=endpoints,
        sync_mode=sync_mode,
        steps=args.steps,
        batch=args.batch,
        seed=args.seed,
        heartbeat_interval=args.heartbeat_interval,
        rpc_workers=args.rpc_workers,
        heartbeat_timeout=args.heartbeat_timeout,
        in_flight=0 if sync_mode else args.in_flight,
        timeout=args.timeout,
        run_dir=run_dir,
        **(
            dict(
                checkpoint_dir=os.path.join(run_dir, "ckpt"),
                # A checkpoint before the kill (at half the pushes) whatever --steps: every step's worth.
                checkpoint_every=1 if sync_mode else k,
                recovery_timeout=args.timeout,
            )
            if args.kill_pserver >= 0
            else {}
        ),
        **hot_standby,
    )
    spec_file = os.path.join(run_dir, "spec.json")
    with open(spec_file, "w") as f:
        f.write(spec.to_json())
    loads = min(args.load, k)
    deadline = time.monotonic() + args.timeout
    env = {"PYTHONPATH": pythonpath_with_repo()}
    worker = [sys.executable, "-m", "benchmarks.jobs.fanin_workers"]
    fault = None
    with stack:

        def start_pserver(i: int, log_name: str, replica: bool = False) -> Command:
            cmd = (
                worker
                + ["pserver", "--spec", spec_file, "--index", str(i)]
                + (["--replica"] if replica else [])
            )
            return stack.enter_context(Command(cmd, os.path.join(run_dir, log_name), env, REPO))

        pservers = [start_pserver(i, f"pserver-{i}.log") for i in range(args.pservers)]
        replicas = [
            start_pserver(i, f"replica-{i}.log", True) for i in range(args.pservers if args.replicas else 0)
        ]
        # Every process of the run starts before this one opens a gRPC channel (see main()).
        load = [
            stack.enter_context(
                Command(
                    worker + ["load", "--spec", spec_file, "--index", str(g), "--of", str(loads)],
                    os.path.join(run_dir, f"load-{g}.log"),
                    env,
                    REPO,
                )
            )
            for g in range(loads)
        ]
        everyone = pservers + replicas + load
        stats = PserverStats(endpoints, spec.replica_endpoints)
        stack.callback(stats.close)
        stats.wait_up(deadline, lambda: check_alive(everyone, "pserver start"))
        pids = [c.proc.pid for c in pservers]
        sampled = list(pids)  # a restarted pserver's peaks are its first process's
        sampler = Sampler(sampled).start()
        stack.callback(sampler.stop)
        at_start = [status(pid) for pid in pids]
        touch(os.path.join(run_dir, "hello"))  # the load generators say Hello for their trainers now
        wait_for_files(
            [os.path.join(run_dir, f"hello-{g}") for g in range(loads)],
            deadline,
            everyone,
            f"{mode} K={k}: Hello",
        )
        check_dropped(stats.get(), k, f"{mode} K={k} after Hello")
        idle = [status(pid) for pid in pids]
        before, cpu_before, t_before = stats.get(), [cpu_seconds(pid) for pid in pids], time.monotonic()
        touch(os.path.join(run_dir, "go"))
        if args.kill_pserver >= 0:
            victim, ep = args.kill_pserver, endpoints[args.kill_pserver]
            # With hot standby the shard's primary, whichever of its two processes that is now.
            on_replica = args.replicas and stats.leader(ep) != ep
            processes = replicas if on_replica else pservers

            def restart() -> None:
                name = f"{'replica' if on_replica else 'pserver'}-{victim}-restarted.log"
                processes[victim] = start_pserver(victim, name, on_replica)

            fault = kill_mid_run(
                processes[victim],
                restart,
                lambda: stats.of(ep),
                before[ep].pushes + k * args.steps // 2,
                deadline,
            )
            fault["killed"] = (
                "primary (replica process)" if on_replica else "primary" if args.replicas else "pserver"
            )
            log.info("%s K=%d: pserver %d killed and restarted: %s", mode, k, victim, fault)
            pids[victim], cpu_before[victim] = pservers[victim].proc.pid, 0.0
            everyone = pservers + replicas + load
        wait_for_files(
            [os.path.join(run_dir, f"stepped-{g}") for g in range(loads)],
            deadline,
            everyone,
            f"{mode} K={k}: steps",
        )
        if fault is not None and args.replicas:
            # The restarted process copies the new primary's state and follows it before the trainers close:
            # one that came up after the job ended would find no primary and lead from its checkpoint.
            def back_in_sync() -> bool:
                s = stats.of(endpoints[args.kill_pserver])
                return s is not None and s.replica.backup_in_sync

            fault["backup_again_s"] = round(
                wait_for(back_in_sync, deadline, "the restarted process in sync", poll=0.2)
                - fault["killed_at"],
                2,
            )
        t_after, cpu_after, after = time.monotonic(), [cpu_seconds(pid) for pid in pids], stats.get()
        stepped = [status(pid) for pid in pids]
        check_dropped(
            after, k, f"{mode} K={k} after the last step", endpoints[args.kill_pserver] if fault else ""
        )
        for ep in endpoints if fault is None else ():  # a restarted pserver counts from its start
            if after[ep].pushes - before[ep].pushes != k * args.steps:
                raise RunFailed(
                    f"{mode} K={k}: pserver {ep} counted {after[ep].pushes - before[ep].pushes} "
                    f"pushes, not {k * args.steps}"
                )
        touch(os.path.join(run_dir, "finish"))
        for g, c in enumerate(load):
            rc = c.wait(max(1.0, deadline - time.monotonic()), f"{mode} K={k}: load generator {g}")
            if rc != 0:
                raise RunFailed(f"{mode} K={k}: load generator {g} exited with {rc}:\n{tail(c.log_path)}")
        for i, c in enumerate(pservers + replicas):  # every trainer closed: each pserver ends by itself
            rc = c.wait(max(1.0, deadline - time.monotonic()), f"{mode} K={k}: pserver {i} after every Close")
            if rc != 0:
                raise RunFailed(f"{mode} K={k}: pserver process {i} exited with {rc}:\n{tail(c.log_path)}")
        peaks = sampler.stop()
    results = [torch.load(os.path.join(run_dir, f"result-{g}.pt")) for g in range(loads)]
    pushes = np.array([p for r in results for p in r["pushes"]], dtype=np.float64)
    check = check_model(spec, results[0]["models"]) if sync_mode else None
    row = summarise(
        mode=mode,
        k=k,
        spec=spec,
        loads=loads,
        pushes=pushes,
        at_start=at_start,
        idle=idle,
        stepped=stepped,
        peaks=[peaks[pid] for pid in sampled],
        cpu=np.subtract(cpu_after, cpu_before),
        before=before,
        after=after,
        window=t_after - t_before,
        check=check,
        row_bytes=ROW_BYTES,
    )
    if fault is not None:
        row["pserver_killed"] = {"index": args.kill_pserver, **recovery_of(fault, pushes, args.kill_pserver)}
    return row


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--trainers", default="16,64,256,1024", help="values of K, comma-separated (default %(default)s)"
    )
    p.add_argument("--modes", default="sync,async", help="sync, async or both (default %(default)s)")
    p.add_argument("--pservers", type=int, default=2, help="pserver processes, 1-4 (default %(default)s)")
    p.add_argument("--load", type=int, default=4, help="load-generator processes (default %(default)s)")
    p.add_argument("--steps", type=int, default=5, help="steps each trainer pushes (default %(default)s)")
    p.add_argument(
        "--batch", type=int, default=512, help="rows of a job S batch (its ids; default %(default)s)"
    )
    p.add_argument("--seed", type=int, default=0, help="of the gradients and ids (default %(default)s)")
    p.add_argument(
        "--heartbeat_interval", type=float, default=2.0, help="the trainers' (default %(default)s)"
    )
    p.add_argument(
        "--heartbeat_timeout",
        type=float,
        default=0.0,
        help="the pservers' (default 0: the library's default, 30 s)",
    )
    p.add_argument(
        "--rpc_workers",
        type=int,
        default=0,
        help="the pservers' pserver_rpc_workers (default 0: the library's default)",
    )
    p.add_argument(
        "--in_flight",
        type=int,
        default=0,
        help="async runs: at most this many of a load generator's trainers inside a step at once "
        "(default 0: all of them; sync runs: always all)",
    )
    p.add_argument(
        "--timeout", type=float, default=900.0, help="seconds one run may take in all (default %(default)s)"
    )
    p.add_argument(
        "--kill_pserver",
        type=int,
        default=-1,
        help="SIGKILL this pserver mid-run and start it again (default -1: none; see the module doc)",
    )
    p.add_argument(
        "--replicas",
        action="store_true",
        help="hot standby: every shard on two processes, with an etcd started here; --kill_pserver then "
        "kills the shard's primary",
    )
    p.add_argument("--json", default=dated_result("fanin"), help="(default %(default)s)")
    p.add_argument(
        "--work", default=None, help="folder for the runs' logs and files (default: a new temporary one)"
    )
    args = p.parse_args(argv)
    try:
        args.trainers = [int(k) for k in args.trainers.split(",")]
    except ValueError:
        p.error(f"--trainers takes integers, got {args.trainers!r}")
    args.modes = [m.strip() for m in args.modes.split(",")]
    if set(args.modes) - {"sync", "async"} or not args.modes:
        p.error(f"--modes takes sync and/or async, got {args.modes}")
    if (
        not 1 <= args.pservers <= 4
        or args.load < 1
        or args.steps < 1
        or args.batch < 1
        or min(args.trainers) < 1
    ):
        p.error("--pservers must be 1-4; --load, --steps, --batch and every K at least 1")
    if args.kill_pserver >= args.pservers:
        p.error(
            f"--kill_pserver must name one of the {args.pservers} pservers (0-based), got {args.kill_pserver}"
        )
    if args.in_flight < 0:
        p.error(f"--in_flight must be >= 0 (0: no bound), got {args.in_flight}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    # This process starts processes (fork, then exec) after its gRPC is running (Stats): with gRPC's fork
    # support on, its fork handlers may abort the child ("epoll_wait error: Bad file descriptor"). Read when
    # gRPC starts, so run as `python -m` (a process whose gRPC has not started yet).
    os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "false"
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The sync check's float64 sums on one thread: with a thread per core, on a loaded machine its small
    # kernels each waited for a thread spinning for a busy core (23 s seen for K=64, 2 s on one thread).
    torch.set_num_threads(1)
    stop_on_signals()
    work = args.work or tempfile.mkdtemp(prefix="bench-fanin-")
    os.makedirs(work, exist_ok=True)
    rows: List[dict] = []
    for k in args.trainers:  # both modes of a K next to each other: the same load on the machine
        for mode in args.modes:
            t0 = time.monotonic()
            rows.append(run_one(args, k, mode == "sync", work))
            log.info("%s K=%d done in %.0f s", mode, k, time.monotonic() - t0)
            if args.json:  # after every run: a later run that fails leaves the earlier ones recorded
                write_json(args.json, rows)
    print(markdown_table(rows))
    if args.json:
        print(f"wrote {args.json}")
    return 0


def write_json(path: str, rows: List[dict]) -> None:
    """The runs so far, with the command, date and core count, to ``path`` (replaced whole)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(
            {
                "command": "python -m benchmarks.bench_fanin " + " ".join(sys.argv[1:]),
                "date": time.strftime("%Y-%m-%d %H:%M"),
                "cores": os.cpu_count(),
                "runs": rows,
            },
            f,
            indent=1,
        )
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    sys.exit(main())
