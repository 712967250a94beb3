"""Dense MLP: 2 pservers x 2 trainers (sync / async) against DDP over gloo on 2 processes.

Usage::

    python benchmarks/bench_dense.py [--runs 5] [--steps 20] [--modes sync,async] [--quick]

Every run starts fresh OS processes on loopback: for DDP two ranks (gloo,
MASTER_ADDR=127.0.0.1, a free port); for the parameter server two pservers
(``ParameterServer(...).serve()``) and two trainers, set up through Paddle's
role variables. Each worker does ``warmup`` untimed steps, then ``steps`` timed
ones (see ``dense_workers.py``). Runs of the configurations are interleaved
round by round (the order rotates each round), so machine noise hits all of
them; the table gives medians with min/max. The script exits non-zero if any
run fails; every child process is stopped on success, failure, Ctrl-C or
SIGTERM, and every wait has a deadline.

Figures per configuration (medians over runs, some with [min-max]):

- samples/s: samples of all workers / wall time of the timed steps of the
  slowest worker; "vs DDP" as the ratio of the medians, and as the median
  [min-max] of the per-round ratios (each PS run / the DDP run of its round).
- push+pull GB/s per trainer: (bytes pushed + pulled during the timed steps)
  / time inside ``tr.step()``, averaged over trainers.
- other load: CPU cores busy with other work (or stolen) during the run,
  from /proc/stat minus this script's processes: the noise indicator.
- time split, ms per step, averaged over workers: the step; forward+backward;
  the update (``tr.step()``; for DDP ``opt.step()`` + ``zero_grad``, as its
  all-reduce runs inside backward and so counts as fwd+bwd) and its share of
  the step. For the parameter server, ``tr.step()`` further split per pserver
  call (the calls to the pservers run in parallel): push; pull until its first
  tensor arrives (in sync mode: the wait for the other trainer and the
  update); the rest of the pull.
- worker CPU: CPU ms of one DDP rank or trainer per timed step, all threads,
  and of it the main thread (forward/backward); the rest is gloo or gRPC.
- pserver CPU: CPU ms of one pserver per training step while serving
  (warmup steps included).
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Sequence, Tuple

from bench_report import loss_check, summarize, tables
from dense_workers import Spec, param_bytes

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = os.path.join(HERE, "dense_workers.py")
TRAINERS = 2
PSERVERS = 2
# After the last trainer closes, pservers must exit on their own within this.
PSERVER_EXIT_GRACE = 30.0
# SIGTERM, then SIGKILL after this many seconds.
STOP_GRACE = 5.0
QUICK_SIZES = (64, 256, 256, 10)


class RunFailed(RuntimeError):
    """A run's process failed or missed its deadline; the message says which and why."""


# -- processes ---------------------------------------------------------------

def _die_with_parent() -> None:
    """In the child before exec: get SIGKILL if the benchmark process dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def free_ports(n: int) -> List[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 right now (all held open while choosing)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def tail(path: str, lines: int = 25) -> str:
    """The last ``lines`` lines of a log file, indented, for error messages."""
    try:
        with open(path, errors="replace") as f:
            text = f.readlines()[-lines:]
    except OSError as e:
        return f"    (no log: {e})"
    return "".join("    " + line for line in text).rstrip()


class Processes:
    """The child processes of one run; leaving the ``with`` block stops any still running.

    Each child runs ``dense_workers.py <role>`` in its own session (so Ctrl-C
    reaches only this script, which then stops the children, and a stop
    reaches the child's own children too), logs to ``<dir>/<name>.log`` and
    writes its result to ``<dir>/<name>.json``. ``prefix`` (e.g. a profiler
    command) goes in front of the Python command.
    """

    def __init__(self, workdir: str, spec: Spec, prefix: Sequence[str] = ()):
        self.workdir = workdir
        self.spec = spec
        self.prefix = list(prefix)
        self.procs: Dict[str, subprocess.Popen] = {}

    def __enter__(self) -> "Processes":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def path(self, name: str, ext: str) -> str:
        return os.path.join(self.workdir, f"{name}.{ext}")

    def spawn(self, name: str, role: str, env: Dict[str, str], profile: bool = False) -> None:
        """Start worker ``name`` in ``role`` with extra environment ``env``."""
        cmd = [sys.executable, WORKERS, role, "--spec", self.spec.to_json(),
               "--out", self.path(name, "json")]
        if profile and self.prefix:
            cmd = [a.replace("{name}", name) for a in self.prefix] + cmd
        with open(self.path(name, "log"), "w") as log:
            self.procs[name] = subprocess.Popen(
                cmd, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)

    def wait(self, names: Sequence[str], deadline: float, what: str) -> None:
        """Until ``names`` all exit 0; raise RunFailed if any child fails or ``deadline`` passes.

        Every child is watched, not only ``names``: a pserver that dies
        early fails the run at once instead of leaving trainers waiting.
        """
        while True:
            for name, p in self.procs.items():
                rc = p.poll()
                if rc not in (None, 0):
                    raise RunFailed(f"{name} exited with code {rc} while waiting for {what}; "
                                    f"log {self.path(name, 'log')}:\n{tail(self.path(name, 'log'))}")
            if all(self.procs[n].poll() == 0 for n in names):
                return
            if time.monotonic() > deadline:
                late = [n for n in names if self.procs[n].poll() is None]
                raise RunFailed(f"deadline passed while waiting for {what}: {late} still running; "
                                f"last lines of {late[0]}:\n{tail(self.path(late[0], 'log'))}")
            time.sleep(0.1)

    def results(self, names: Sequence[str]) -> List[dict]:
        """The result JSON each of ``names`` wrote."""
        out = []
        for name in names:
            try:
                with open(self.path(name, "json")) as f:
                    out.append(json.load(f))
            except (OSError, ValueError) as e:
                raise RunFailed(f"{name} exited 0 but left no readable result: {e}") from None
        return out

    def stop(self) -> None:
        """SIGTERM every running child's process group, SIGKILL what is left after a grace."""
        running = [p for p in self.procs.values() if p.poll() is None]
        for p in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE
        for p in running:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=STOP_GRACE)


# -- one run of each system ------------------------------------------------

def run_ddp(spec: Spec, workdir: str, timeout: float) -> Tuple[List[dict], List[dict]]:
    """Two DDP ranks over gloo on loopback; returns (each rank's timings, no servers)."""
    (port,) = free_ports(1)
    names = [f"ddp{r}" for r in range(TRAINERS)]
    with Processes(workdir, spec) as procs:
        for rank, name in enumerate(names):
            procs.spawn(name, "ddp", {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                      "RANK": str(rank), "WORLD_SIZE": str(TRAINERS)})
        procs.wait(names, time.monotonic() + timeout, "the DDP ranks")
        return procs.results(names), []


def run_ps(spec: Spec, workdir: str, timeout: float,
           profile: Sequence[str] = ()) -> Tuple[List[dict], List[dict]]:
    """Two pservers and two trainers; returns (each trainer's timings, each pserver's CPU).

    The pservers must exit by themselves once the trainers have closed.
    """
    endpoints = [f"127.0.0.1:{p}" for p in free_ports(PSERVERS)]
    common = {"PADDLE_PSERVERS_IP_PORT_LIST": ",".join(endpoints),
              "PADDLE_TRAINERS_NUM": str(TRAINERS)}
    servers = [f"pserver{i}" for i in range(PSERVERS)]
    trainers = [f"trainer{i}" for i in range(TRAINERS)]
    with Processes(workdir, spec, profile) as procs:
        for name, ep in zip(servers, endpoints):
            ip, port = ep.rsplit(":", 1)
            procs.spawn(name, "pserver", {**common, "TRAINING_ROLE": "PSERVER",
                                          "POD_IP": ip, "PADDLE_PORT": port}, profile=True)
        for tid, name in enumerate(trainers):
            procs.spawn(name, "trainer", {**common, "TRAINING_ROLE": "TRAINER",
                                          "PADDLE_TRAINER_ID": str(tid)}, profile=True)
        procs.wait(trainers, time.monotonic() + timeout, "the trainers")
        procs.wait(servers, time.monotonic() + PSERVER_EXIT_GRACE,
                   "the pservers to exit after all trainers closed")
        return procs.results(trainers), procs.results(servers)


# -- driver --------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=None, help="runs per configuration (default 5; quick 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default 20; quick 5)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; quick 1)")
    p.add_argument("--modes", default="sync,async", help="parameter-server modes: sync,async")
    p.add_argument("--no-ddp", dest="ddp", action="store_false", help="skip the DDP baseline")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke test: MLP {'-'.join(map(str, QUICK_SIZES))}, batch 32, 1 run")
    p.add_argument("--timeout", type=float, default=None,
                   help="deadline of one run in s (default 600; quick 120)")
    p.add_argument("--json", help="also write every run's figures here")
    p.add_argument("--logdir", help="keep worker logs here (default: a temp dir, kept on failure)")
    p.add_argument("--py-spy", dest="py_spy", metavar="DIR",
                   help="record each pserver and trainer with py-spy (raw collapsed stacks) "
                        "into DIR/<round>-<config>-<name>.txt")
    p.add_argument("--py-spy-args", default="--threads --rate 100",
                   help="py-spy record options (default: %(default)s, i.e. on-CPU samples "
                        "only; add --idle for wall-clock, --native for C/C++ frames)")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not set(modes) <= {"sync", "async"}:
        p.error(f"--modes takes sync and/or async, got {args.modes!r}")
    args.configs = (["ddp"] if args.ddp else []) + [f"ps-{m}" for m in modes]
    if not args.configs:
        p.error("nothing to run")
    if args.py_spy and shutil.which("py-spy") is None:
        p.error("--py-spy needs py-spy on PATH (pip install py-spy)")
    quick = args.quick

    def pick(value, quick_default, default):
        return value if value is not None else (quick_default if quick else default)

    args.runs = pick(args.runs, 1, 5)
    args.timeout = pick(args.timeout, 120.0, 600.0)
    args.spec = Spec(sizes=QUICK_SIZES if quick else Spec.sizes, batch=32 if quick else 256,
                     steps=pick(args.steps, 5, 20), warmup=pick(args.warmup, 1, 3),
                     timeout=args.timeout)
    if args.runs < 1 or args.spec.steps < 1 or args.spec.warmup < 0 or args.timeout <= 0:
        p.error("--runs and --steps must be >= 1, --warmup >= 0, --timeout > 0")
    return args


def py_spy_prefix(outdir: str, tag: str, options: str) -> List[str]:
    """A py-spy command that records the wrapped worker into ``outdir/<tag>-{name}.txt``."""
    return ["py-spy", "record", *shlex.split(options), "--format", "raw",
            "--output", os.path.join(outdir, f"{tag}-{{name}}.txt"), "--"]


def busy_cpu_seconds() -> Tuple[float, float]:
    """(CPU seconds the whole machine was busy or stolen, CPU seconds of this process and its
    reaped children), both since boot; on a system without /proc/stat the first is NaN."""
    mine = os.times()
    ours = mine.user + mine.system + mine.children_user + mine.children_system
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return float("nan"), ours
    # user nice system idle iowait irq softirq steal ...: all but idle and iowait are busy
    busy = sum(fields[:8]) - fields[3] - fields[4]
    return busy / os.sysconf("SC_CLK_TCK"), ours


def run_one(config: str, rnd: int, args, workdir: str) -> dict:
    """One run of ``config`` in round ``rnd``; its figures.

    Also measures ``other_load``: the CPU cores, averaged over the run (start-up
    included), that were busy with something other than this benchmark or
    stolen by the hypervisor; a noise indicator for a shared machine.
    """
    busy0, ours0, t0 = *busy_cpu_seconds(), time.monotonic()
    row = _run_config(config, rnd, args, workdir)
    busy1, ours1 = busy_cpu_seconds()
    row["other_load"] = max(0.0, (busy1 - busy0) - (ours1 - ours0)) / (time.monotonic() - t0)
    return row


def _run_config(config: str, rnd: int, args, workdir: str) -> dict:
    """Start the processes of one ``config`` run and summarize what they report."""
    spec = args.spec
    if config == "ddp":
        workers, servers = run_ddp(spec, workdir, args.timeout)
    else:
        spec = Spec(**{**spec.__dict__, "sync_mode": config == "ps-sync"})
        prefix = (py_spy_prefix(args.py_spy, f"{rnd}-{config}", args.py_spy_args)
                  if args.py_spy else ())
        workers, servers = run_ps(spec, workdir, args.timeout, prefix)
    return {"round": rnd, **summarize(config, spec, workers, servers)}


def _raise_on_signal(signum, frame):
    raise SystemExit(128 + signum)


def main(argv=None) -> int:
    args = parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_on_signal)  # so the `with` blocks stop the children
    if args.py_spy:
        os.makedirs(args.py_spy, exist_ok=True)
    logdir = args.logdir or tempfile.mkdtemp(prefix="bench_dense-")
    spec = args.spec
    print(f"MLP {'-'.join(map(str, spec.sizes))}: {param_bytes(spec.sizes) / 1e6:.1f} MB float32; "
          f"batch {spec.batch}/worker, {TRAINERS} workers, {spec.warmup} warmup + {spec.steps} "
          f"timed steps, {args.runs} runs of {', '.join(args.configs)}", flush=True)
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
                extra = f", {row['gbps']:.3f} GB/s push+pull per trainer" if "gbps" in row else ""
                print(f"  round {rnd} {config:9s} {row['samples_s']:8.0f} samples/s "
                      f"(compute {row['compute_ms']:.0f} ms, update {row['update_ms']:.0f} ms "
                      f"per step{extra}; other load {row['other_load']:.2f} cores)", flush=True)
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
    print(tables(rows, args.configs))
    worst = loss_check(rows)
    if worst is not None:
        print(f"\nloss check: per-step losses of PS sync and DDP differ by at most {worst:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
