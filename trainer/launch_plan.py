"""Planning a ps-launch job: parse the command line, decide which roles run on this host.

Pure pieces (no process is started here), each testable on its own:
``parse_args`` -> ``plan_roles`` (a list of :class:`Role`) -> ``child_env``.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from transpiler.env import NODE_VARS, PSERVER, ROLE_VARS, TRAINER, NodeEnv, RoleEnv, parse_endpoints
from psproto.security import Security

DESCRIPTION = """ps-launch: start the pservers and trainers of a job, as Paddle's launcher does in pserver mode.

    ps-launch --server_num 2 --worker_num 2 examples/train_mlp.py --epochs 20
    ps-launch --servers 10.0.0.1:6170,10.0.0.2:6170 --workers 10.0.0.1,10.0.0.2 train.py
    ps-launch --server_num 2 --worker_num 2 --nproc_per_node 4 --gpus 0,1,2,3,4,5,6,7 train.py
    ps-launch --worker_num 2 --nproc_per_node 2 train.py      # collective: no pservers

Local mode (--server_num/--worker_num) runs every role on this machine, pservers
on 127.0.0.1. Per-host mode (--servers/--workers) describes the whole cluster: run
the same command on every host and each starts only its own roles. Every role runs
`python SCRIPT ARGS...` with TRAINING_ROLE, PADDLE_* and POD_IP set (see
transpiler/env.py, RoleEnv), its output in LOG_DIR/serverlog.N or LOG_DIR/workerlog.N.
A trainer node runs --nproc_per_node processes, each with LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE (NodeEnv); local rank R > 0 logs to
LOG_DIR/workerlog.N.R. Without --server_num/--servers the job is collective: trainers
only, one process group of every process of every node.
Access control: --auth_token_file FILE gives every role the job's token; PS_TLS_*
variables set for the launcher pass to every role (see proto/security.py).
Exit status: 0 when every trainer exited 0, 1 when a role failed, 2 on bad input,
130/143 when stopped by SIGINT/SIGTERM.
"""



class LaunchError(ValueError):
    """Bad launcher input; reported as ``ps-launch: error: ...`` with exit code 2."""


@dataclass
class Role:
    """One process of the job: its kind, global index, host and role variables; ``proc`` once started."""

    kind: str
    index: int
    host: str
    env: Dict[str, str]
    endpoint: Optional[str] = None
    log_path: Optional[str] = None
    proc: Optional[subprocess.Popen] = field(default=None, repr=False)
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def name(self) -> str:
        """``pserver.N``, ``trainer.N`` or (a node of several processes) ``trainer.N.R``."""
        if self.local_world_size > 1:
            return f"{self.kind.lower()}.{self.index}.{self.local_rank}"
        return f"{self.kind.lower()}.{self.index}"

    @property
    def title(self) -> str:
        """How failure messages name the process: ``trainer node N local rank R (pid P)`` or its name."""
        if self.local_world_size > 1:
            pid = f" (pid {self.proc.pid})" if self.proc is not None else ""
            return f"trainer node {self.index} local rank {self.local_rank}{pid}"
        return self.name

    @property
    def log_name(self) -> str:
        """``serverlog.N``, ``workerlog.N`` (local rank 0) or ``workerlog.N.R`` (local rank R > 0)."""
        if self.kind == PSERVER:
            return f"serverlog.{self.index}"
        return f"workerlog.{self.index}" + (f".{self.local_rank}" if self.local_rank else "")

    @property
    def alive(self) -> bool:
        """Started and not yet exited (polling reaps an exited process)."""
        return self.proc is not None and self.proc.poll() is None


def build_parser() -> argparse.ArgumentParser:
    """The launcher's argument parser; the script and its arguments are split off before it runs."""
    p = argparse.ArgumentParser(prog="ps-launch", usage="%(prog)s [options] SCRIPT [script args...]",
                                description=DESCRIPTION, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server_num", type=int, metavar="N", help="local mode: number of pservers on 127.0.0.1")
    p.add_argument("--worker_num", type=int, metavar="M", help="local mode: number of trainer nodes (trainer ids)")
    p.add_argument("--servers", metavar="IP:PORT,...", help="per-host mode: every pserver endpoint")
    p.add_argument("--workers", metavar="IP,...", help="per-host mode: every trainer node's ip (id = position)")
    p.add_argument("--host", metavar="IP", help="this host in --servers/--workers (default: any local ip)")
    p.add_argument("--start_port", type=int, metavar="P", help="local mode: pserver ports P, P+1, ... "
                   "(default: free ports)")
    p.add_argument("--log_dir", default="log", metavar="DIR",
                   help="where serverlog.N, workerlog.N (local rank 0) and workerlog.N.R (local rank R) go "
                   "(default: log)")
    p.add_argument("--server_grace", type=float, default=30.0, metavar="SEC",
                   help="time pservers get to exit by themselves once the trainers finished (default 30); "
                   "not applied when trainers of the job run on other hosts")
    p.add_argument("--term_timeout", type=float, default=10.0, metavar="SEC",
                   help="time between SIGTERM and SIGKILL when stopping roles (default 10)")
    p.add_argument("--nproc_per_node", type=int, metavar="L",
                   help="processes per trainer node (one per GPU): each gets LOCAL_RANK 0..L-1, "
                   "LOCAL_WORLD_SIZE, MASTER_ADDR/MASTER_PORT, RANK, WORLD_SIZE "
                   "(default: the number of --gpus per node on this host, else 1)")
    p.add_argument("--gpus", metavar="ID,...",
                   help="GPUs of this host for its trainer processes: CUDA_VISIBLE_DEVICES, split in order "
                   "among this host's trainer nodes (L each); pservers always get CUDA_VISIBLE_DEVICES=''")
    p.add_argument("--master_port", type=int, metavar="P",
                   help="collective mode: the job's rendezvous port on MASTER_ADDR (the first --workers "
                   "host; default 29500 per-host, a free port locally); pserver mode with "
                   "--nproc_per_node > 1: this host's trainer nodes meet on P, P+1, ... (default: free ports)")
    p.add_argument("--auth_token_file", metavar="FILE",
                   help="access control: every role gets PS_AUTH_TOKEN_FILE=FILE (made absolute), so "
                   "pservers refuse calls without the token in FILE and trainers send it. PS_AUTH_TOKEN "
                   "and PS_TLS_* set for ps-launch reach every role as they are")
    p.add_argument("script", nargs="?", metavar="SCRIPT", help="training script run by every role")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="...", help="passed to SCRIPT as is")
    return p


def split_argv(parser: argparse.ArgumentParser, argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    """Split ``argv`` into (launcher options, [SCRIPT, script args...]) at the first positional.

    Done by hand rather than with ``argparse.REMAINDER`` alone because argparse
    swallows a ``--`` among the script's arguments; here they pass through byte for byte.
    """
    takes_value = {s for a in parser._actions for s in a.option_strings if a.nargs != 0}
    argv = list(argv)
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return argv[:i], argv[i + 1:]
        if not token.startswith("-") or token == "-":
            return argv[:i], argv[i:]
        i += 2 if token in takes_value else 1
    return argv, []


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the command line; argparse errors (and a missing SCRIPT) exit with code 2."""
    parser = build_parser()
    own, rest = split_argv(parser, sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(own)
    if not rest:
        parser.error("no SCRIPT given: ps-launch [options] SCRIPT [script args...]")
    args.script, args.script_args = rest[0], rest[1:]
    return args


def free_ports(n: int, host: str = "127.0.0.1") -> List[int]:
    """``n`` distinct ports the OS reports free on ``host`` (all held open until every one is picked)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _resolve(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def local_addresses() -> set:
    """IPv4 addresses of this host: loopback, the hostname's addresses and every interface's (Linux)."""
    addrs = {"127.0.0.1"}
    try:
        addrs.update(info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET))
    except OSError:
        pass
    try:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                try:  # SIOCGIFADDR; fails for an interface without an IPv4 address
                    packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
                    addrs.add(socket.inet_ntoa(packed[20:24]))
                except OSError:
                    pass
    except (ImportError, OSError):
        pass
    return addrs


def host_matcher(host: Optional[str] = None) -> Callable[[str], bool]:
    """A predicate "does this ip (or hostname) belong to this host?" for ``--host`` (None: auto-detect)."""
    if host:
        mine = _resolve(host)
        return lambda h: h == host or _resolve(h) == mine
    local = local_addresses()
    return lambda h: h.startswith("127.") or h == "localhost" or _resolve(h) in local


def is_collective(args: argparse.Namespace) -> bool:
    """No --server_num and no --servers: a collective job, trainers only."""
    return args.server_num is None and args.servers is None


def _check_args(args: argparse.Namespace) -> None:
    for one, many, kind in (("server_num", "servers", "pservers"), ("worker_num", "workers", "trainers")):
        num, listed = getattr(args, one), getattr(args, many)
        if num is not None and listed is not None:
            raise LaunchError(f"--{one} and --{many} both given: use --{one} for local {kind} "
                              f"or --{many} for per-host mode, not both")
        if num is None and listed is None and kind == "trainers":
            raise LaunchError(f"no {kind}: give --{one} N (local) or --{many} (per-host)")
        if num is not None and num < 1:
            raise LaunchError(f"--{one} must be >= 1, got {num}")
    nproc = getattr(args, "nproc_per_node", None)
    if nproc is not None and nproc < 1:
        raise LaunchError(f"--nproc_per_node must be >= 1, got {nproc}")
    master_port = getattr(args, "master_port", None)
    if master_port is not None and not 0 < master_port < 65536:
        raise LaunchError(f"--master_port must be a port number, got {master_port}")
    if args.start_port is not None:
        if args.server_num is None and args.servers is None:
            raise LaunchError("--start_port applies to --server_num; a collective job has no pservers")
        if args.servers is not None:
            raise LaunchError("--start_port applies to --server_num (local mode); --servers has its ports")
        if not 0 < args.start_port <= 65536 - args.server_num:
            raise LaunchError(f"--start_port {args.start_port} leaves no room for {args.server_num} ports")
    if args.server_grace < 0 or args.term_timeout < 0:
        raise LaunchError("--server_grace and --term_timeout must be >= 0")
    if args.script is None or not os.path.isfile(args.script):
        raise LaunchError(f"script {args.script!r} not found")
    if getattr(args, "auth_token_file", None) is not None:
        # Checked here so a bad token file fails the launch once, not every role.
        given = {"PS_AUTH_TOKEN_FILE": os.path.abspath(args.auth_token_file)}
        if "PS_AUTH_TOKEN" in os.environ:
            given["PS_AUTH_TOKEN"] = os.environ["PS_AUTH_TOKEN"]
        try:
            Security.from_env(given)
        except ValueError as e:
            raise LaunchError(f"--auth_token_file: {e}") from None


def parse_gpus(gpus: str, environ: Mapping[str, str]) -> List[str]:
    """``--gpus 0,1,...`` as a list; ids must be in an inherited ``CUDA_VISIBLE_DEVICES`` (as Paddle's launcher)."""
    ids = [g.strip() for g in gpus.split(",")]
    if not all(ids):
        raise LaunchError(f"--gpus {gpus!r} is malformed: expected id,id,... (as CUDA_VISIBLE_DEVICES)")
    dupes = sorted({g for g in ids if ids.count(g) > 1})
    if dupes:
        raise LaunchError(f"--gpus lists GPU {','.join(dupes)} twice")
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        allowed = [v.strip() for v in visible.split(",")]
        outside = [g for g in ids if g not in allowed]
        if outside:
            raise LaunchError(f"--gpus {gpus}: GPU {','.join(outside)} is not in this launcher's "
                              f"CUDA_VISIBLE_DEVICES={visible}; --gpus names GPUs from that list")
    return ids


def _node_layout(args: argparse.Namespace, local_nodes: int,
                 environ: Mapping[str, str]) -> Tuple[int, List[Optional[str]]]:
    """(processes per node, CUDA_VISIBLE_DEVICES of each of this host's trainer nodes, None: inherited)."""
    nproc = getattr(args, "nproc_per_node", None)
    if getattr(args, "gpus", None) is None:
        return nproc or 1, [None] * local_nodes
    gpus = parse_gpus(args.gpus, environ)
    if nproc is None:
        if local_nodes and len(gpus) % local_nodes:
            raise LaunchError(f"--gpus lists {len(gpus)} GPUs for {local_nodes} trainer nodes on this host: "
                              f"give --nproc_per_node (GPUs per node)")
        nproc = len(gpus) // max(local_nodes, 1)
    if nproc * local_nodes > len(gpus):
        raise LaunchError(f"--nproc_per_node {nproc} x {local_nodes} trainer node(s) on this host need "
                          f"{nproc * local_nodes} GPUs, --gpus lists {len(gpus)} ({args.gpus}): one process per GPU")
    return nproc, [",".join(gpus[k * nproc:(k + 1) * nproc]) for k in range(local_nodes)]


DEFAULT_MASTER_PORT = 29500  # torchrun's


def plan_roles(args: argparse.Namespace, is_local: Optional[Callable[[str], bool]] = None,
               pick_ports: Callable[[int], List[int]] = free_ports,
               environ: Optional[Mapping[str, str]] = None) -> List[Role]:
    """Validate the arguments and list this host's processes, pservers first, each with its variables.

    Raises :class:`LaunchError` on bad input. ``is_local`` (default
    ``host_matcher(args.host)``) picks this host's entries of ``--servers`` and
    ``--workers``; ``pick_ports(n)`` chooses free ports (local-mode pservers,
    rendezvous ports); ``environ`` (default os.environ) is the launcher's
    environment, read for CUDA_VISIBLE_DEVICES.

    Each trainer node (an entry of ``--workers``, or one of ``--worker_num``) runs
    ``--nproc_per_node`` processes, in node order then local rank. Pservers get
    ``CUDA_VISIBLE_DEVICES=''``; with ``--gpus``, this host's k-th trainer node gets
    the k-th slice of L GPUs.
    """
    _check_args(args)
    environ = os.environ if environ is None else environ
    is_local = is_local or host_matcher(args.host)
    collective = is_collective(args)
    if args.servers is not None:
        try:
            endpoints = parse_endpoints(args.servers)
        except ValueError as e:
            raise LaunchError(f"--servers: {e}") from None
    elif collective:
        endpoints = []
    else:
        endpoints = None  # local pservers: ports picked below, with the rendezvous ports
    if args.workers is not None:
        # Accept "ip" or Paddle's "ip:port"; a trainer's port has no use in pserver mode.
        workers = [w.strip().split(":")[0] for w in args.workers.split(",")]
        if not all(workers):
            raise LaunchError(f"--workers {args.workers!r} is malformed: expected ip,ip,...")
    else:
        workers = ["127.0.0.1"] * args.worker_num
    local_nodes = [i for i, ip in enumerate(workers) if args.workers is None or is_local(ip)]
    nproc, node_gpus = _node_layout(args, len(local_nodes), environ)

    # Free ports: local pservers' (without --start_port), then where each local node's
    # processes meet (pserver mode, several processes) or where the whole job meets
    # (local collective), none of them in the --start_port range.
    master_port = getattr(args, "master_port", None)
    local_servers = endpoints is None
    taken = set(range(args.start_port, args.start_port + args.server_num)) if args.start_port else set()
    n_servers = args.server_num if local_servers and not args.start_port else 0
    if collective:
        n_meet = 0 if master_port or args.workers is not None else 1
    else:
        n_meet = len(local_nodes) if nproc > 1 and not master_port else 0
    ports = []
    if n_servers + n_meet:
        ports = [p for p in pick_ports(n_servers + n_meet + (len(taken) if n_meet else 0)) if p not in taken]
    if local_servers:
        server_ports = sorted(taken) if args.start_port else ports[:n_servers]
        endpoints = [f"127.0.0.1:{p}" for p in server_ports]
    ports = ports[n_servers:]
    if collective:
        if args.workers is not None:
            job_master = (workers[0], master_port or DEFAULT_MASTER_PORT)
        else:
            job_master = ("127.0.0.1", master_port or ports[0])
    else:
        node_ports = ([master_port + k for k in range(len(local_nodes))] if master_port
                      else ports[:len(local_nodes)])
        if nproc > 1:
            if any(p > 65535 for p in node_ports):
                raise LaunchError(f"--master_port {master_port} leaves no room for {len(local_nodes)} nodes")
            clash = sorted({f"{workers[i]}:{p}" for i, p in zip(local_nodes, node_ports)} & set(endpoints))
            if clash:
                raise LaunchError(f"--master_port: a trainer node's rendezvous port is a pserver's: {clash}")

    common = {}
    if getattr(args, "auth_token_file", None) is not None:
        # Absolute: a role may change directory before it reads the variable.
        common["PS_AUTH_TOKEN_FILE"] = os.path.abspath(args.auth_token_file)
    roles = []
    for i, ep in enumerate(endpoints):
        ip = ep.rpartition(":")[0]
        if args.servers is None or is_local(ip):
            env = dict(common, **RoleEnv(PSERVER, endpoints, len(workers), current_endpoint=ep).to_env())
            env["CUDA_VISIBLE_DEVICES"] = ""  # a pserver is a CPU process: no CUDA context on a trainer's GPU
            roles.append(Role(PSERVER, i, ip, env, endpoint=ep))
    for k, i in enumerate(local_nodes):
        ip = workers[i]
        for r in range(nproc):
            if collective:
                node = NodeEnv(r, nproc, job_master[0], job_master[1], i * nproc + r, len(workers) * nproc)
            elif nproc > 1:
                node = NodeEnv(r, nproc, ip, node_ports[k], r, nproc)
            else:
                node = NodeEnv()  # one process per node: today's variables only
            env = dict(common, **RoleEnv(TRAINER, endpoints, len(workers), trainer_id=i, node=node).to_env())
            if node_gpus[k] is not None:
                env["CUDA_VISIBLE_DEVICES"] = node_gpus[k]
            roles.append(Role(TRAINER, i, ip, env, local_rank=r, local_world_size=nproc))
    if not roles:
        host = args.host or "auto-detected " + ",".join(sorted(local_addresses()))
        raise LaunchError(f"this host ({host}) has no role in --servers/--workers; give --host IP")
    return roles


def child_env(role: Role, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The environment of ``role``'s process: ``base`` (default os.environ) plus its role variables.

    Role and node variables inherited from ``base`` are dropped first, so a launcher
    run inside another job (or under torchrun) cannot leak, say, a PADDLE_TRAINER_ID
    into a pserver or a LOCAL_RANK into a trainer.
    """
    dropped = set(ROLE_VARS) | set(NODE_VARS)
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in dropped}
    env.update(role.env)
    env["PYTHONUNBUFFERED"] = "1"
    return env
