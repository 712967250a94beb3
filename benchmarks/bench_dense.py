"""Dense MLP: parameter servers (plain trainers, trainer nodes; sync / async) against DDP over gloo.

Usage::

    python benchmarks/bench_dense.py [--processes 4] [--nproc_per_node 2] [--runs 5] [--steps 20]
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
untimed steps, then ``steps`` timed ones (see ``dense_workers.py``). Runs of
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
- bytes pushed per step (``tr.comm.bytes_pushed``): per process; per node,
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
import contextlib
import ctypes
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

from bench_report import loss_check, summarize, tables
from dense_workers import Spec, param_bytes

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = os.path.join(HERE, "dense_workers.py")
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

def run_ddp(spec: Spec, workdir: str, timeout: float, processes: int) -> Tuple[List[dict], List[dict]]:
    """``processes`` DDP ranks over gloo on loopback; returns (each rank's timings, no servers)."""
    (port,) = free_ports(1)
    names = [f"ddp{r}" for r in range(processes)]
    with Processes(workdir, spec) as procs:
        for rank, name in enumerate(names):
            procs.spawn(name, "ddp", {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                      "RANK": str(rank), "WORLD_SIZE": str(processes)})
        procs.wait(names, time.monotonic() + timeout, "the DDP ranks")
        return procs.results(names), []


def run_ps(spec: Spec, workdir: str, timeout: float, processes: int, per_node: int = 1,
           profile: Sequence[str] = (), replicas: int = 1,
           coordinator: Optional[str] = None) -> Tuple[List[dict], List[dict]]:
    """Two pservers and ``processes`` trainer processes; (each trainer process's timings, each pserver's CPU).

    ``per_node`` > 1 groups the processes into ``processes // per_node``
    trainer nodes (``LOCAL_RANK``/``LOCAL_WORLD_SIZE``, each node meeting at
    its own ``MASTER_PORT``): the pservers then see one trainer per node.
    The pservers must exit by themselves once the trainers have closed.
    ``replicas`` 2 (hot standby) also starts a backup per pserver
    (``pserverN.replica``, not in the returned figures) and gives every role
    the ``PS_*`` replica variables, with etcd at ``coordinator`` and a key
    prefix of this run's own, as ps-launch does.
    """
    nodes = processes // per_node
    backups = PSERVERS if replicas == 2 else 0
    ports = free_ports(PSERVERS + backups + (nodes if per_node > 1 else 0))
    endpoints = [f"127.0.0.1:{p}" for p in ports[:PSERVERS]]
    replica_eps = [f"127.0.0.1:{p}" for p in ports[PSERVERS:PSERVERS + backups]]
    node_ports = ports[PSERVERS + backups:]
    common = {"PADDLE_PSERVERS_IP_PORT_LIST": ",".join(endpoints),
              "PADDLE_TRAINERS_NUM": str(nodes)}
    if replicas == 2:
        if not coordinator:
            raise ValueError("replicas=2 needs coordinator: the etcd URL that decides each shard's primary")
        common.update({"PS_SERVER_REPLICAS": "2", "PS_REPLICA_ENDPOINTS": ",".join(replica_eps),
                       "PS_COORDINATOR": coordinator,
                       "PS_COORDINATOR_PREFIX": f"/torch-pserver/bench-dense-{secrets.token_hex(6)}"})
    servers = [f"pserver{i}" for i in range(PSERVERS)]
    replica_names = [f"pserver{i}.replica" for i in range(backups)]
    trainers: List[Tuple[str, Dict[str, str]]] = []
    for node in range(nodes):
        for local in range(per_node):
            env = {**common, "TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": str(node)}
            if per_node > 1:
                env.update({"LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(per_node),
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(node_ports[node])})
            trainers.append((f"trainer{node}" + (f".{local}" if per_node > 1 else ""), env))
    names = [name for name, _ in trainers]
    with Processes(workdir, spec, profile) as procs:
        for name, ep in zip(servers + replica_names, endpoints + replica_eps):
            ip, port = ep.rsplit(":", 1)
            procs.spawn(name, "pserver", {**common, "TRAINING_ROLE": "PSERVER",
                                          "POD_IP": ip, "PADDLE_PORT": port}, profile=True)
        for name, env in trainers:
            procs.spawn(name, "trainer", env, profile=True)
        procs.wait(names, time.monotonic() + timeout, "the trainers")
        procs.wait(servers + replica_names, time.monotonic() + PSERVER_EXIT_GRACE,
                   "the pservers to exit after all trainers closed")
        return procs.results(names), procs.results(servers)


# -- driver --------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=None, help="runs per configuration (default 5; quick 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default 20; quick 5)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; quick 1)")
    p.add_argument("--processes", type=int, default=4,
                   help="worker processes of every configuration: DDP ranks, plain trainers, and the "
                        "local processes of all trainer nodes together (default 4; 2 is the older "
                        "2-trainer job)")
    p.add_argument("--nproc_per_node", type=int, default=None,
                   help="local processes per trainer node of the ps-<mode>-node configurations "
                        "(default 2 when --processes is even and > 2, else 1; 1 runs no node configuration)")
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
    if args.processes < 1:
        p.error("--processes must be >= 1")
    if args.nproc_per_node is None:
        args.nproc_per_node = 2 if args.processes > 2 and args.processes % 2 == 0 else 1
    if args.nproc_per_node < 1 or args.processes % args.nproc_per_node:
        p.error(f"--nproc_per_node must be >= 1 and divide --processes ({args.processes}), "
                f"got {args.nproc_per_node}")
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
        workers, servers = run_ddp(spec, workdir, args.timeout, args.processes)
    else:
        spec = Spec(**{**spec.__dict__, "sync_mode": config.startswith("ps-sync")})
        prefix = (py_spy_prefix(args.py_spy, f"{rnd}-{config}", args.py_spy_args)
                  if args.py_spy else ())
        per_node = args.nproc_per_node if config.endswith("-node") else 1
        workers, servers = run_ps(spec, workdir, args.timeout, args.processes, per_node, prefix)
    return {"round": rnd, **summarize(config, spec, workers, servers, args.nproc_per_node)}


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
          f"batch {spec.batch}/worker, {args.processes} worker processes (nodes of "
          f"{args.nproc_per_node}), {PSERVERS} pservers, {spec.warmup} warmup + {spec.steps} "
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
                extra = (f", {row['gbps']:.3f} GB/s push+pull per process, "
                         f"{row['mb_pushed_node']:.1f} MB pushed per node" if "gbps" in row else "")
                print(f"  round {rnd} {config:13s} {row['samples_s']:8.0f} samples/s "
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
    print(tables(rows, args.configs, args.processes, args.nproc_per_node, PSERVERS))
    worst = loss_check(rows)
    if worst:
        print()
    for config, diff in worst.items():
        print(f"loss check: per-step losses of {config} and DDP (same global rank) differ by at most {diff:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
