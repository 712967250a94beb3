"""Planning a ps-launch job: decide which roles run on this host, and with which variables.

Pure pieces (no process is started here), each testable on its own:
``parse_args`` (args) -> ``plan_roles`` (a list of :class:`Role`) -> ``child_env``.
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import subprocess
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Tuple

from psproto.security import Security
from transpiler.roles.role_env import (
    NODE_VARS,
    PSERVER,
    ROLE_VARS,
    TRAINER,
    NodeEnv,
    RoleEnv,
    parse_endpoints,
)

from ..board.settings import DIR_VAR as TENSORBOARD_DIR_VAR

# The command line lives in args; these names stay importable from here.
from .args import DESCRIPTION, LOG_LEVEL_VAR, build_parser, parse_args, split_argv  # noqa: F401


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
    command: Optional[List[str]] = None  # what started it (and starts it again on a restart)
    restarts: int = 0  # restarts of its unit (a trainer node restarts as a whole)
    replica: int = 0  # hot standby: 1 for a pserver's second process

    def started(self, proc: subprocess.Popen) -> None:
        """The role runs as ``proc`` now (its first start, or a restart)."""
        self.proc = proc

    @property
    def name(self) -> str:
        """``pserver.N``, ``trainer.N`` or (a node of several processes) ``trainer.N.R``."""
        if self.local_world_size > 1:
            return f"{self.kind.lower()}.{self.index}.{self.local_rank}"
        return f"{self.kind.lower()}.{self.index}" + (".replica" if self.replica else "")

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
            return f"serverlog.{self.index}" + (".replica" if self.replica else "")
        return f"workerlog.{self.index}" + (f".{self.local_rank}" if self.local_rank else "")

    @property
    def tag(self) -> str:
        """The console prefix and ``--show`` name: ``pserverN``, ``trainerN``, ``trainerN.R`` (local rank R
        > 0)."""
        return (
            f"{self.kind.lower()}{self.index}"
            + (f".{self.local_rank}" if self.local_rank else "")
            + (".replica" if self.replica else "")
        )

    @property
    def unit(self) -> Tuple[str, int, int]:
        """What stops and restarts together: a pserver process, or a trainer node with all its local ranks."""
        return self.kind, self.index, self.replica

    @property
    def alive(self) -> bool:
        """Started and not yet exited (polling reaps an exited process)."""
        return self.proc is not None and self.proc.poll() is None


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


def _check_replicas(args: argparse.Namespace) -> None:
    replicas = getattr(args, "server_replicas", 1)
    if replicas not in (1, 2):
        raise LaunchError(f"--server_replicas must be 1 or 2 (a backup per pserver), got {replicas}")
    if replicas == 1:
        if getattr(args, "replica_servers", None) or getattr(args, "coordinator", None):
            raise LaunchError("--replica_servers and --coordinator need --server_replicas 2")
        return
    if is_collective(args):
        raise LaunchError("--server_replicas 2 replicates pservers; a collective job has none")
    if not getattr(args, "coordinator", None):
        raise LaunchError(
            "--server_replicas 2 needs --coordinator: the etcd URLs that decide each shard's "
            'primary (e.g. http://127.0.0.1:2379; README "Hot standby")'
        )
    if args.servers is not None:
        if not getattr(args, "replica_servers", None):
            raise LaunchError(
                "--server_replicas 2 with --servers needs --replica_servers: each pserver's backup"
            )
        try:
            n, m = len(parse_endpoints(args.servers)), len(parse_endpoints(args.replica_servers))
        except ValueError as e:
            raise LaunchError(f"--replica_servers: {e}") from None
        if n != m:
            raise LaunchError(
                f"--replica_servers lists {m} endpoints for {n} --servers; give one backup each"
            )
    elif getattr(args, "replica_servers", None):
        raise LaunchError("--replica_servers is for per-host mode (--servers); local mode picks the ports")


def _check_args(args: argparse.Namespace) -> None:
    for one, many, kind in (("server_num", "servers", "pservers"), ("worker_num", "workers", "trainers")):
        num, listed = getattr(args, one), getattr(args, many)
        if num is not None and listed is not None:
            raise LaunchError(
                f"--{one} and --{many} both given: use --{one} for local {kind} "
                f"or --{many} for per-host mode, not both"
            )
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
    max_restarts = getattr(args, "max_restarts", 0)
    if max_restarts < 0:
        raise LaunchError(f"--max_restarts must be >= 0, got {max_restarts}")
    if max_restarts and args.server_num is None and args.servers is None:
        # A DDP group cannot take a new process in: a restarted collective trainer would wait
        # for peers that never come back.
        raise LaunchError(
            "--max_restarts needs pservers: a collective job (no --server_num/--servers) has no "
            "recovery to restart a trainer into"
        )
    if args.server_grace < 0 or args.term_timeout < 0:
        raise LaunchError("--server_grace and --term_timeout must be >= 0")
    board = getattr(args, "tensorboard_dir", None)
    if board is not None and (not board.strip() or (os.path.exists(board) and not os.path.isdir(board))):
        raise LaunchError(
            f"--tensorboard_dir {board!r} is not a directory (TensorBoard's log directory of the job)"
        )
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
    """``--gpus 0,1,...`` as a list; ids must be in an inherited ``CUDA_VISIBLE_DEVICES`` (as Paddle's
    launcher)."""
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
            raise LaunchError(
                f"--gpus {gpus}: GPU {','.join(outside)} is not in this launcher's "
                f"CUDA_VISIBLE_DEVICES={visible}; --gpus names GPUs from that list"
            )
    return ids


def _node_layout(
    args: argparse.Namespace, local_nodes: int, environ: Mapping[str, str]
) -> Tuple[int, List[Optional[str]]]:
    """(processes per node, CUDA_VISIBLE_DEVICES of each of this host's trainer nodes, None: inherited)."""
    nproc = getattr(args, "nproc_per_node", None)
    if getattr(args, "gpus", None) is None:
        return nproc or 1, [None] * local_nodes
    gpus = parse_gpus(args.gpus, environ)
    if nproc is None:
        if local_nodes and len(gpus) % local_nodes:
            raise LaunchError(
                f"--gpus lists {len(gpus)} GPUs for {local_nodes} trainer nodes on this host: "
                f"give --nproc_per_node (GPUs per node)"
            )
        nproc = len(gpus) // max(local_nodes, 1)
    if nproc * local_nodes > len(gpus):
        raise LaunchError(
            f"--nproc_per_node {nproc} x {local_nodes} trainer node(s) on this host need "
            f"{nproc * local_nodes} GPUs, --gpus lists {len(gpus)} ({args.gpus}): one process per GPU"
        )
    return nproc, [",".join(gpus[k * nproc : (k + 1) * nproc]) for k in range(local_nodes)]


DEFAULT_MASTER_PORT = 29500  # torchrun's


def plan_roles(
    args: argparse.Namespace,
    is_local: Optional[Callable[[str], bool]] = None,
    pick_ports: Callable[[int], List[int]] = free_ports,
    environ: Optional[Mapping[str, str]] = None,
) -> List[Role]:
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
    _check_replicas(args)
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
    replicas = getattr(args, "server_replicas", 1) or 1
    taken = (
        set(range(args.start_port, args.start_port + args.server_num * replicas))
        if args.start_port
        else set()
    )
    n_servers = args.server_num * replicas if local_servers and not args.start_port else 0
    if collective:
        n_meet = 0 if master_port or args.workers is not None else 1
    else:
        n_meet = len(local_nodes) if nproc > 1 and not master_port else 0
    ports = []
    if n_servers + n_meet:
        ports = [p for p in pick_ports(n_servers + n_meet + (len(taken) if n_meet else 0)) if p not in taken]
    backups: List[str] = []
    if local_servers:
        server_ports = sorted(taken) if args.start_port else ports[:n_servers]
        endpoints = [f"127.0.0.1:{p}" for p in server_ports]
        endpoints, backups = endpoints[: args.server_num], endpoints[args.server_num :]
    elif replicas == 2:
        backups = parse_endpoints(args.replica_servers)
    ports = ports[n_servers:]
    if collective:
        if args.workers is not None:
            job_master = (workers[0], master_port or DEFAULT_MASTER_PORT)
        else:
            job_master = ("127.0.0.1", master_port or ports[0])
    else:
        node_ports = (
            [master_port + k for k in range(len(local_nodes))] if master_port else ports[: len(local_nodes)]
        )
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
    if getattr(args, "log_level_given", False):
        common[LOG_LEVEL_VAR] = args.log_level
    if getattr(args, "tensorboard_dir", None):
        common[TENSORBOARD_DIR_VAR] = os.path.abspath(args.tensorboard_dir)  # absolute, as the token file
    if replicas == 2:
        common.update(replica_env(backups, args.coordinator))
    roles = []
    for replica, group in enumerate((endpoints, backups)):
        for i, ep in enumerate(group):
            ip = ep.rpartition(":")[0]
            if args.servers is None or is_local(ip):
                env = dict(common, **RoleEnv(PSERVER, endpoints, len(workers), current_endpoint=ep).to_env())
                env["CUDA_VISIBLE_DEVICES"] = (
                    ""  # a pserver is a CPU process: no CUDA context on a trainer's GPU
                )
                roles.append(Role(PSERVER, i, ip, env, endpoint=ep, replica=replica))
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


# An outer torchrun's variables: with TORCHELASTIC_USE_AGENT_STORE inherited, torch's tcp:// rendezvous
# would make a node's local rank 0 a client of a store nobody hosts here.
_LAUNCHER_PREFIXES = ("TORCHELASTIC_", "GROUP_", "ROLE_")


def replica_env(backups: List[str], coordinator: str) -> Dict[str, str]:
    """The hot-standby variables every role of a replicated job gets (read by transpiler/roles/replicas.py).

    The etcd key prefix is new per launch: a launch never waits for the replicas of an earlier one.
    """
    return {
        "PS_SERVER_REPLICAS": "2",
        "PS_REPLICA_ENDPOINTS": ",".join(backups),
        "PS_COORDINATOR": coordinator,
        "PS_COORDINATOR_PREFIX": f"/torch-pserver/launch-{secrets.token_hex(6)}",
    }


def child_env(role: Role, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The environment of ``role``'s process: ``base`` (default os.environ) plus its role variables.

    Role and node variables inherited from ``base`` are dropped first, so a launcher
    run inside another job (or under torchrun) cannot leak, say, a PADDLE_TRAINER_ID
    into a pserver, a LOCAL_RANK into a trainer, or torchrun's own variables into a node.
    """
    dropped = set(ROLE_VARS) | set(NODE_VARS)
    env = {
        k: v
        for k, v in (os.environ if base is None else base).items()
        if k not in dropped and not k.startswith(_LAUNCHER_PREFIXES)
    }
    env.update(role.env)
    env["PYTHONUNBUFFERED"] = "1"
    return env
