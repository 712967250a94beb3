"""Planning a ps-launch job: decide which roles run on this host, and with which variables.

Pure pieces (no process is started here), each testable on its own: ``parse_args``
(:mod:`.args`) -> :func:`plan_roles` (its input checked by :mod:`.arg_checks`, this host
told by :mod:`.hosts`; a list of :class:`~.role.Role`) -> :func:`~.role.child_env`.
"""

from __future__ import annotations

import argparse
import os
import secrets
from typing import Callable, Dict, List, Mapping, Optional, Tuple

from transpiler.roles.role_env import PSERVER, TRAINER, NodeEnv, RoleEnv, parse_endpoints

from ..board.settings import DIR_VAR as TENSORBOARD_DIR_VAR
from .arg_checks import LaunchError, check_args, check_replicas, is_collective

# The command line lives in args; these names stay importable from here.
from .args import DESCRIPTION, LOG_LEVEL_VAR, build_parser, parse_args, split_argv  # noqa: F401
from .hosts import free_ports, host_matcher, local_addresses
from .role import Role


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
    check_args(args)
    check_replicas(args)
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
