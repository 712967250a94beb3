"""The checks of ps-launch's arguments, each failing with a :class:`LaunchError` that names the flag.

:func:`check_args` and :func:`check_replicas` run before any role is planned (:func:`.plan.plan_roles`),
so bad input fails the launch once, before a process starts.
"""

from __future__ import annotations

import argparse
import os

from psproto.security import Security
from transpiler.roles.role_env import parse_endpoints


class LaunchError(ValueError):
    """Bad launcher input; reported as ``ps-launch: error: ...`` with exit code 2."""


def is_collective(args: argparse.Namespace) -> bool:
    """No --server_num and no --servers: a collective job, trainers only."""
    return args.server_num is None and args.servers is None


def check_replicas(args: argparse.Namespace) -> None:
    """Hot standby's flags: ``--server_replicas``, its ``--coordinator`` and ``--replica_servers``."""
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


def check_args(args: argparse.Namespace) -> None:
    """The other flags: role counts and lists, ports, restarts, timeouts, the board, the script, the token."""
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
