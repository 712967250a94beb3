"""The throughput cost of hot standby: job S and job D with a backup per pserver against the same job without.

    python -m benchmarks.bench_replication [--rounds 3] [--jobs s,d] [--async]

One etcd process serves the whole run (:mod:`harness.etcd`, as the tests start it: its own data
directory in the run's temp folder, free 127.0.0.1 ports, ``--heartbeat-interval 50
--election-timeout 500``); it is stopped at the end, failure or Ctrl-C included. Each job runs
2 pservers x 2 trainers, in alternating rounds (round r runs "plain" then "replicated" when r is
even, the reverse when odd):

- job S (``benchmarks/jobs/job_s.py`` through ps-launch, sync unless ``--async``): "replicated" adds
  ``--server_replicas 2 --coordinator URL``, so ps-launch starts ``pserverN.replica`` next to
  each pserver and gives every role its own etcd key prefix (one per launch);
- job D (the dense MLP of ``common/dense_runs.run_ps``, sync): "replicated" spawns a backup pserver per
  pserver with ``PS_SERVER_REPLICAS``/``PS_REPLICA_ENDPOINTS``/``PS_COORDINATOR`` and a
  ``PS_COORDINATOR_PREFIX`` of the run's own.

Every replicated run is checked before its figures count (the run fails loudly otherwise): per shard
one process led from start to end and logged "backup ... is in sync at message N"
(``pserver/replication/outbox.py``), the other logged that it follows it, both logged the same final
update count at exit, and no digest mismatch, fencing or dropped backup was logged. The updates
replicated per run are the backups' final counts less the update of their snapshots. While any run
goes on, every pserver process's Stats is read each second (plain runs too, so both pay the same),
which gives the messages the primaries sent (``replica.replicated``, as of the last read before exit).

Prints examples/s (job D: samples/s) of each configuration as median [min-max] over rounds, the
per-round ratio replicated / plain and its median (goal >= 0.8x), the AUC (job S) or final loss
(job D) of both (the same training), and a markdown table for ``benchmarks/results/RESULTS.md`` with the
command and the machine. ``--s_steps``/``--d_steps`` and the other step flags make a smoke run short.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
from typing import Dict, List

from benchmarks.common.machine import cpu_model
from benchmarks.common.paths import DEFAULT_PEERS, peer_module
from benchmarks.common.peer_runners import run_ours_d, run_ours_s
from benchmarks.jobs.dense_workers import param_bytes
from benchmarks.reports.dense import med
from harness.etcd import EtcdServer, start_etcd
from harness.processes import RunFailed, tail

CONFIGS = ("plain", "replicated")
# The variables that would turn a "plain" run into a replicated one if the caller's shell had them.
REPLICA_VARS = ("PS_SERVER_REPLICAS", "PS_REPLICA_ENDPOINTS", "PS_COORDINATOR", "PS_COORDINATOR_PREFIX")
STATS_PERIOD = 1.0

# What the pserver processes log (pserver/server.py, pserver/replication/{outbox,replica,follower}.py).
SERVING = re.compile(r"pserver (\S+) serving \d+ blocks")
IN_SYNC = re.compile(r"primary (\S+): backup (\S+) is in sync at message (\d+)")
FOLLOWS = re.compile(r"replica (\S+) follows (\S+) \(epoch (\d+)\) from update (\d+)")
LEADS = re.compile(r"replica (\S+) leads shard (\d+) at epoch (\d+)")
STOPPED = re.compile(r"pserver (\S+) stopped after (\d+) updates")
TROUBLE = re.compile(
    r"differs from the primary's|: fenced|lost the lead|backup \S+ dropped|did not take message"
)


# -- Stats while a run goes on ------------------------------------------------------------------


class StatsPoller:
    """Reads every pserver process's Stats each :data:`STATS_PERIOD` s while one run goes on; keeps the
    last answer.

    The pserver processes are found by their "serving" log line in the files matching ``log_glob``. A
    process that stopped answering keeps its last answer, so :attr:`last` holds each one's figures from
    shortly before it exited: ``updates``, and with replicas its ``role``, ``replicated`` (messages sent by
    a primary, applied by a backup), ``in_sync`` and ``mismatches``. A context manager: the thread stops on
    exit.
    """

    def __init__(self, log_glob: str):
        self.log_glob = log_glob
        self.last: Dict[str, dict] = {}
        self._endpoints: Dict[str, str] = {}  # log path -> endpoint
        self._channels = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="stats-poller")

    def __enter__(self) -> "StatsPoller":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for channel in self._channels.values():
            channel.close()

    def _discover(self) -> None:
        """Note the endpoint of every pserver log that has logged it since the last look."""
        for path in glob.glob(self.log_glob):
            if path in self._endpoints:
                continue
            with contextlib.suppress(OSError), open(path, errors="replace") as f:
                m = SERVING.search(f.read())
            if m:
                self._endpoints[path] = m.group(1)

    def _run(self) -> None:
        """The thread: each period, find new pserver logs, then ask every known process for its Stats (1 s
        deadline)."""
        from psproto import ps_pb2, ps_pb2_grpc
        from psproto.security import Security

        security = Security.from_env()
        while not self._stop.wait(STATS_PERIOD):
            self._discover()
            for ep in self._endpoints.values():
                if ep not in self._channels:
                    self._channels[ep] = security.channel(ep)
                try:
                    r = ps_pb2_grpc.ParameterServerStub(self._channels[ep]).Stats(
                        ps_pb2.StatsRequest(), timeout=1.0
                    )
                except Exception:  # noqa: BLE001 - not up yet, or gone: keep the last answer
                    continue
                answer = {"updates": r.step}
                if r.HasField("replica"):
                    answer.update(
                        role=r.replica.role,
                        replicated=r.replica.replicated,
                        in_sync=r.replica.backup_in_sync,
                        mismatches=r.replica.digest_mismatches,
                    )
                self.last[ep] = answer


# -- the replication check ----------------------------------------------------------------------


def _read(path: str) -> str:
    """A log file's text ('' if it is missing)."""
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def check_replicated(pairs: List[List[str]], stats: Dict[str, dict]) -> dict:
    """Whether each shard really had a backup in sync to the end, from its two processes' logs; RunFailed
    if not.

    ``pairs`` holds each shard's two log files. Per shard: one process led, from start to end (no
    takeover), and logged its backup "in sync at message N"; the other logged that it follows it from some
    update; both logged the same final update count (so the backup applied every update the primary made
    after the snapshot); and neither logged a digest mismatch, fencing, or a dropped backup. Returns per
    shard the primary, the update the backup started from, the final updates, the updates the backup
    received as messages (``messages``: final updates - the update of its snapshot), and the messages the
    primary had sent by its last Stats (``stats``; roster changes included, the last second missing).
    """
    shards = []
    for k, logs in enumerate(pairs):
        texts = [_read(p) for p in logs]
        where = " and ".join(logs)
        trouble = [m.group(0) for t in texts for m in TROUBLE.finditer(t)]
        if trouble:
            raise RunFailed(f"shard {k}: the replication had trouble ({sorted(set(trouble))}); logs {where}")
        in_sync = [m for t in texts for m in IN_SYNC.finditer(t)]
        follows = [m for t in texts for m in FOLLOWS.finditer(t)]
        stopped = [int(m.group(2)) for t in texts for m in STOPPED.finditer(t)]
        if not in_sync or not follows:
            raise RunFailed(
                f"shard {k} did not replicate: {'no' if not in_sync else 'a'} 'is in sync at message' "
                f"line, {'no' if not follows else 'a'} 'follows' line; logs {where}:\n"
                + "\n".join(tail(p, 15) for p in logs)
            )
        leads = [m.group(0) for t in texts for m in LEADS.finditer(t)]
        if len(leads) != 1:
            raise RunFailed(
                f"shard {k}: {len(leads)} processes took the lead ({leads}); a healthy run has one "
                f"primary from start to end; logs {where}"
            )
        if len(stopped) != 2 or stopped[0] != stopped[1] or stopped[0] == 0:
            raise RunFailed(
                f"shard {k}: its two processes ended at different update counts {stopped} "
                f"(the backup must hold every update); logs {where}"
            )
        primary = in_sync[-1].group(1)
        from_update = int(follows[-1].group(4))
        sent = stats.get(primary, {}).get("replicated")
        shards.append(
            {
                "primary": primary,
                "backup": in_sync[-1].group(2),
                "backup_from_update": from_update,
                "updates": stopped[0],
                "messages": stopped[0] - from_update,
                "messages_stats": sent or 0,
            }
        )
    return {
        "shards": shards,
        "messages": sum(s["messages"] for s in shards),
        "messages_stats": sum(s["messages_stats"] for s in shards),
        "updates": shards[0]["updates"],
    }


# -- one run of each job ------------------------------------------------------------------------


def run_s(args, work: str, name: str, config: str, etcd: EtcdServer) -> dict:
    """One job S run (``config`` plain or replicated) in its own work directory, checked when replicated."""
    workdir = os.path.join(work, name)
    os.makedirs(workdir)
    replicas = 2 if config == "replicated" else 1
    with StatsPoller(os.path.join(workdir, "log", "serverlog.*")) as poller:
        res = run_ours_s(args, workdir, args.sync, replicas=replicas, coordinator=etcd.url)
    if replicas == 2:
        logs = os.path.join(workdir, "log")
        res["replication"] = check_replicated(
            [
                [os.path.join(logs, f"serverlog.{k}"), os.path.join(logs, f"serverlog.{k}.replica")]
                for k in range(res["pservers"])
            ],
            poller.last,
        )
    res["quality"] = res["auc"]
    waited = [
        p
        for p in glob.glob(os.path.join(workdir, "log", "workerlog.*"))
        if "not every trainer registered" in _read(p)
    ]
    if waited:
        res["note"] = (
            f"{len(waited)} trainer(s) waited job_s.py's --eval_wait (120 s, untimed) for a backup's "
            f"Stats to list them"
        )
    return res


def run_d(args, work: str, name: str, config: str, etcd: EtcdServer) -> dict:
    """One job D run (``config`` plain or replicated) in its own work directory, checked when replicated."""
    workdir = os.path.join(work, name)
    os.makedirs(workdir)
    replicas = 2 if config == "replicated" else 1
    with StatsPoller(os.path.join(workdir, "pserver*.log")) as poller:
        res = run_ours_d(args, workdir, replicas=replicas, coordinator=etcd.url)
    if replicas == 2:
        res["replication"] = check_replicated(
            [
                [os.path.join(workdir, f"pserver{k}.log"), os.path.join(workdir, f"pserver{k}.replica.log")]
                for k in range(2)
            ],
            poller.last,
        )
    res["quality"] = res["final_loss"]
    return res


JOBS = {"s": run_s, "d": run_d}


# -- report -------------------------------------------------------------------------------------


def machine() -> str:
    """``nproc`` and the CPU model from /proc/cpuinfo."""
    return f"{cpu_model()}, nproc {os.cpu_count()}"


def bytes_to_backups(args, job: str, res: dict) -> str:
    """What the primaries send their backups per step, as far as it is known without measuring the stream.

    Job D: each sync step's mean dense gradient, float32, the whole model over
    both shards (computed from the sizes). Job S: not known without counting
    the stream (the step's merged table rows vary), so "-".
    """
    if job != "d":
        return "-"
    sizes = peer_module(args.peers, "jobs").D_SIZES
    return f"{param_bytes(sizes) / 1e6:.1f} MB (computed: the float32 gradient)"


def report(args, runs: Dict[str, Dict[str, List[dict]]], argv: List[str]) -> None:
    """Print each job's figures, the per-round ratios, and the markdown table for RESULTS.md."""
    rows = []
    for job, by_config in runs.items():
        unit = "examples/s" if job == "s" else "samples/s"
        quality = "AUC" if job == "s" else "final loss"
        ratios = [
            r["examples_s"] / p["examples_s"] for p, r in zip(by_config["plain"], by_config["replicated"])
        ]
        speed = {c: med([r["examples_s"] for r in rs], ",.0f") for c, rs in by_config.items()}
        q = {c: [r["quality"] for r in rs] for c, rs in by_config.items()}
        last = by_config["replicated"][-1]["replication"]
        messages = [r["replication"]["messages"] for r in by_config["replicated"]]
        sent = [r["replication"]["messages_stats"] for r in by_config["replicated"]]
        mode = ("sync" if args.sync else "async") if job == "s" else "sync"
        print(f"\njob {job.upper()} ({mode}, 2 ps x 2 trainers), {len(ratios)} alternating rounds")
        for c in CONFIGS:
            print(f"  {c:>10}: {speed[c]} {unit}; {quality} {', '.join(f'{x:.4f}' for x in q[c])}")
        print(
            f"  replicated / plain per round: {', '.join(f'{x:.2f}' for x in ratios)} "
            f"(median {statistics.median(ratios):.2f}, goal >= 0.8)"
        )
        led = ", ".join(
            f"shard {k} led by {s['primary']}, its backup from update {s['backup_from_update']}"
            for k, s in enumerate(last["shards"])
        )
        print(
            f"  replication (last round): {led}; {last['updates']} updates per shard; "
            f"updates replicated per run (both shards) {messages}, messages sent by the last Stats {sent}"
        )
        spread = max(abs(a - b) for a in q["plain"] for b in q["replicated"])
        if mode == "sync" and spread > 1e-3:
            print(
                f"  NOTE: the {quality} of plain and replicated differ by up to {spread:.4g}: "
                f"sync training should be the same arithmetic with or without a backup"
            )
        rows.append((job, mode, unit, quality, speed, q, ratios, messages, bytes_to_backups(args, job, last)))
    print("\n--- for benchmarks/results/RESULTS.md ---\n")
    print("```\npython -m benchmarks.bench_replication " + " ".join(shlex.quote(a) for a in argv) + "\n```\n")
    print(
        f'Machine: {machine()}. 2 pservers x 2 trainers each; "replicated" adds a backup per pserver '
        f"(`server_replicas=2`, one local etcd); alternating rounds, medians [min-max].\n"
    )
    print(
        "| job | plain | replicated | replicated / plain per round | median | AUC / final loss "
        "(plain; replicated) | updates replicated per run | bytes to the backups per step |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for job, mode, unit, quality, speed, q, ratios, messages, per_step in rows:
        print(
            f"| {job.upper()}, {mode} ({unit}) | {speed['plain']} | {speed['replicated']} | "
            f"{', '.join(f'{x:.2f}' for x in ratios)} | **{statistics.median(ratios):.2f}x** | "
            f"{quality} {statistics.median(q['plain']):.4f}; {statistics.median(q['replicated']):.4f} | "
            f"{', '.join(map(str, messages))} | {per_step} |"
        )


# -- driver -------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--rounds", type=int, default=3, help="alternating rounds of plain and replicated (default 3)"
    )
    p.add_argument("--jobs", default="s,d", help="jobs to run: s,d (default both)")
    p.add_argument(
        "--async", dest="sync", action="store_false", help="job S asynchronous (job D is always sync)"
    )
    p.add_argument(
        "--peers", default=DEFAULT_PEERS, help="the peers' folder, for jobs.py (default: %(default)s)"
    )
    p.add_argument("--s_warmup", type=int, default=20, help="job S warm-up steps (default %(default)s)")
    p.add_argument("--s_steps", type=int, default=200, help="job S timed steps (default %(default)s)")
    p.add_argument("--s_batch", type=int, default=512, help="job S batch per trainer (default %(default)s)")
    p.add_argument("--s_eval", type=int, default=20000, help="job S hold-out examples (default %(default)s)")
    p.add_argument("--d_warmup", type=int, default=5, help="job D warm-up steps (default %(default)s)")
    p.add_argument("--d_steps", type=int, default=30, help="job D timed steps (default %(default)s)")
    p.add_argument("--timeout", type=float, default=900, help="deadline of one run in s (default 900)")
    p.add_argument(
        "--keep", action="store_true", help="keep the work directory (logs) after a successful run"
    )
    args = p.parse_args(argv)
    args.jobs = [j.strip().lower() for j in args.jobs.split(",") if j.strip()]
    if not args.jobs or not set(args.jobs) <= set(JOBS):
        p.error(f"--jobs takes s and/or d, got {args.jobs!r}")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    return args


def main(argv=None) -> int:
    """Start etcd, run every job's rounds alternating plain and replicated, report; etcd stopped whatever
    happens."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    for var in REPLICA_VARS:  # a plain run must be plain, whatever this shell exported
        os.environ.pop(var, None)
    work = tempfile.mkdtemp(prefix="bench-replication-")
    print(f"work directory {work}; {machine()}", flush=True)
    runs = {job: {c: [] for c in CONFIGS} for job in args.jobs}
    etcd = None
    try:
        etcd = start_etcd(work)
        print(f"etcd at {etcd.url} (pid {etcd.proc.pid})", flush=True)
        for r in range(args.rounds):
            for job in args.jobs:
                for config in CONFIGS if r % 2 == 0 else CONFIGS[::-1]:
                    res = JOBS[job](args, work, f"{job}-{config}-{r}", config, etcd)
                    runs[job][config].append(res)
                    extra = ""
                    if config == "replicated":
                        rep = res["replication"]
                        extra = (
                            f"; {rep['messages']} updates replicated ({rep['messages_stats']} messages by "
                            f"the last Stats), "
                            f"{rep['updates']} updates per shard, "
                            f"primaries {[s['primary'] for s in rep['shards']]}"
                        )
                    if res.get("note"):
                        extra += f" (note: {res['note']})"
                    print(
                        f"round {r} job {job.upper()} {config}: {res['examples_s']:,.0f} "
                        f"{'examples' if job == 's' else 'samples'}/s, "
                        f"{'AUC' if job == 's' else 'final loss'} {res['quality']:.4f}{extra}",
                        flush=True,
                    )
    except (RunFailed, KeyboardInterrupt) as e:
        print(f"FAILED: {e}\nlogs kept in {work}", file=sys.stderr, flush=True)
        return 1
    finally:
        if etcd is not None:
            etcd.stop()
            shutil.rmtree(etcd.data_dir, ignore_errors=True)  # 60+ MB of WAL; its log stays
    report(args, runs, argv)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
