"""ps-launch's command line: the options (with torchrun's dash and Paddle 2.x spellings) and their parsing.

Pure: ``parse_args(argv)`` returns an ``argparse.Namespace``; checking the
values against each other is ``plan``'s job.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from typing import List, Optional, Sequence, Tuple

DESCRIPTION = """ps-launch: start the pservers and trainers of a job, as Paddle's launcher does in pserver
mode.

    ps-launch --server_num 2 --worker_num 2 examples/train_mlp.py --epochs 20
    ps-launch --servers 10.0.0.1:6170,10.0.0.2:6170 --workers 10.0.0.1,10.0.0.2 train.py
    ps-launch --server_num 2 --worker_num 2 --nproc_per_node 4 --gpus 0,1,2,3,4,5,6,7 train.py
    ps-launch --worker_num 2 --nproc_per_node 2 train.py      # collective: no pservers
    ps-launch --server_num 2 --worker_num 2 --max_restarts 3 train.py --checkpoint_dir ckpt
    ps-launch --server_num 2 --server_replicas 2 --coordinator http://127.0.0.1:2379 --worker_num 2 train.py

Local mode (--server_num/--worker_num) runs every role on this machine, pservers
on 127.0.0.1. Per-host mode (--servers/--workers) describes the whole cluster: run
the same command on every host and each starts only its own roles. Every role runs
`python SCRIPT ARGS...` with TRAINING_ROLE, PADDLE_* and POD_IP set (see
transpiler/roles/role_env.py, RoleEnv), its output in LOG_DIR/serverlog.N or LOG_DIR/workerlog.N.
A trainer node runs --nproc_per_node processes, each with LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE (NodeEnv); local rank R > 0 logs to
LOG_DIR/workerlog.N.R. Without --server_num/--servers the job is collective: trainers
only, one process group of every process of every node.
Console: the output of the roles chosen by --show (default trainer 0) is copied to
stdout as it is written, each line prefixed [trainer0], [pserver1], [trainer0.1] (local
rank 1); progress bars ('\\r' updates) stay on one line on a terminal and become a line
every few seconds otherwise. The launcher's own messages start with "ps-launch:".
Restarts: with --max_restarts N a role that dies (non-zero exit or a signal) is started
again, same command and variables, its log appended, up to N times per role (a trainer
node restarts as a whole); the pservers' and trainers' recovery does the rest (a
pserver resumes from its checkpoint_dir). LOG_DIR/roles.json lists every process's pid.
Hot standby: --server_replicas 2 starts a second process for every pserver (pserverN.replica,
LOG_DIR/serverlog.N.replica); etcd at --coordinator decides which of the two leads. Every role
gets PS_SERVER_REPLICAS, PS_REPLICA_ENDPOINTS, PS_COORDINATOR and PS_COORDINATOR_PREFIX (one per
launch, so a new launch never waits for an old one's replicas).
TensorBoard: --tensorboard_dir DIR gives every role PS_TENSORBOARD_DIR; `tensorboard --logdir DIR` shows it.
Access control: --auth_token_file FILE gives every role the job's token; PS_TLS_*
variables set for the launcher pass to every role (see proto/security.py).
Exit status: 0 when every trainer exited 0, 1 when a role failed (with no restarts
left), 2 on bad input, 130/143 when stopped by SIGINT/SIGTERM.
"""

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# The variable that carries --log_level to the roles (and sets the launcher's level when no flag is given).
LOG_LEVEL_VAR = "PS_LOG_LEVEL"
# One --show item: a kind, or a role as its console prefix names it (trainer0, pserver1, trainer0.1).
_SHOW_ITEM = re.compile(r"^(all|none|trainers|pservers|(trainer|pserver)\.?(\d+)(\.(\d+))?)$")


def log_level(value: str) -> str:
    """An argparse type: a logging level name (any case), returned in upper case."""
    level = value.strip().upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{value!r} is not a log level: use one of {', '.join(LOG_LEVELS)}")
    return level


def show_spec(value: str) -> Tuple[str, ...]:
    """An argparse type for ``--show``: comma-separated items, normalised (``trainer.0`` -> ``trainer0``).

    Items: ``all``, ``none``, ``trainers``, ``pservers``, or a role: ``trainerN``,
    ``pserverN``, ``trainerN.R`` (local rank R of trainer node N; ``trainerN`` is its local rank 0).
    """
    items = []
    for raw in value.split(","):
        m = _SHOW_ITEM.match(raw.strip().lower())
        if not m:
            raise argparse.ArgumentTypeError(
                f"{raw.strip()!r} is not a role: use all, none, trainers, pservers or names such as "
                f"trainer0, pserver1, trainer0.1 (local rank 1 of trainer node 0), comma-separated"
            )
        if m.group(2):
            rank = int(m.group(5) or 0)
            items.append(f"{m.group(2)}{int(m.group(3))}" + (f".{rank}" if rank else ""))
        else:
            items.append(m.group(1))
    if "none" in items and len(items) > 1:
        raise argparse.ArgumentTypeError("--show none cannot be combined with other roles")
    return tuple(items)


def _add(p: argparse.ArgumentParser, name: str, *aliases: str, **kwargs) -> None:
    """An option under its underscore name, torchrun's dash spelling and any ``aliases``."""
    names = [name] + ([name.replace("_", "-")] if "_" in name else []) + list(aliases)
    for alias in aliases:
        if "_" in alias:
            names.append(alias.replace("_", "-"))
    p.add_argument(*dict.fromkeys(names), **kwargs)


def build_parser() -> argparse.ArgumentParser:
    """The launcher's argument parser; the script and its arguments are split off before it runs."""
    p = argparse.ArgumentParser(
        prog="ps-launch",
        usage="%(prog)s [options] SCRIPT [script args...]",
        description=DESCRIPTION,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add(p, "--server_num", type=int, metavar="N", help="local mode: number of pservers on 127.0.0.1")
    _add(
        p,
        "--worker_num",
        "--trainer_num",
        type=int,
        metavar="M",
        help="local mode: number of trainer nodes (trainer ids); --trainer_num is Paddle 2.x's name",
    )
    _add(p, "--servers", metavar="IP:PORT,...", help="per-host mode: every pserver endpoint")
    _add(
        p,
        "--workers",
        "--trainers",
        metavar="IP,...",
        help="per-host mode: every trainer node's ip (id = position; Paddle's ip:port also accepted)",
    )
    _add(
        p,
        "--server_replicas",
        type=int,
        default=1,
        metavar="R",
        help='2: a hot-standby backup for every pserver (README "Hot standby"); local mode picks its ports, '
        "per-host mode takes them from --replica_servers; needs --coordinator (default 1)",
    )
    _add(
        p,
        "--replica_servers",
        metavar="IP:PORT,...",
        help="per-host mode with --server_replicas 2: each pserver's backup, in the order of --servers",
    )
    _add(
        p,
        "--coordinator",
        metavar="URL,...",
        help="with --server_replicas 2: the etcd URLs that decide each shard's primary (PS_COORDINATOR)",
    )
    _add(p, "--host", metavar="IP", help="this host in --servers/--workers (default: any local ip)")
    _add(
        p,
        "--start_port",
        type=int,
        metavar="P",
        help="local mode: pserver ports P, P+1, ... (default: free ports)",
    )
    _add(
        p,
        "--log_dir",
        default="log",
        metavar="DIR",
        help="where serverlog.N, workerlog.N (local rank 0), workerlog.N.R (local rank R) and roles.json "
        "go (default: log)",
    )
    _add(
        p,
        "--log_level",
        type=log_level,
        metavar="LEVEL",
        help=f"the launcher's messages at this level and above (DEBUG, INFO, WARNING, ERROR); also given to "
        f"every role as {LOG_LEVEL_VAR} (default: ${LOG_LEVEL_VAR}, else INFO)",
    )
    _add(
        p,
        "--show",
        type=show_spec,
        metavar="ROLES",
        help="whose output to copy to stdout, prefixed [role]: all, none, trainers, pservers, or roles "
        "such as trainer0,pserver1,trainer0.1 (default: trainer0; on a host without trainer 0, its first "
        "trainer)",
    )
    _add(
        p,
        "--max_restarts",
        "--max_restart",
        type=int,
        default=0,
        metavar="N",
        help="start a role that died (non-zero exit or a signal) again, up to N times per role "
        "(a trainer node restarts as a whole); then the job stops as without restarts (default 0). Pserver "
        "mode only",
    )
    _add(
        p,
        "--server_grace",
        type=float,
        default=30.0,
        metavar="SEC",
        help="time pservers get to exit by themselves once the trainers finished (default 30); "
        "not applied when trainers of the job run on other hosts",
    )
    _add(
        p,
        "--term_timeout",
        type=float,
        default=10.0,
        metavar="SEC",
        help="time between SIGTERM and SIGKILL when stopping roles (default 10)",
    )
    _add(
        p,
        "--nproc_per_node",
        type=int,
        metavar="L",
        help="processes per trainer node (one per GPU): each gets LOCAL_RANK 0..L-1, "
        "LOCAL_WORLD_SIZE, MASTER_ADDR/MASTER_PORT, RANK, WORLD_SIZE "
        "(default: the number of --gpus per node on this host, else 1)",
    )
    _add(
        p,
        "--gpus",
        "--devices",
        metavar="ID,...",
        help="GPUs of this host for its trainer processes: CUDA_VISIBLE_DEVICES, split in order "
        "among this host's trainer nodes (L each); pservers always get CUDA_VISIBLE_DEVICES=''",
    )
    _add(
        p,
        "--master_port",
        type=int,
        metavar="P",
        help="collective mode: the job's rendezvous port on MASTER_ADDR (the first --workers "
        "host; default 29500 per-host, a free port locally); pserver mode with "
        "--nproc_per_node > 1: this host's trainer nodes meet on P, P+1, ... (default: free ports)",
    )
    _add(
        p,
        "--auth_token_file",
        metavar="FILE",
        help="access control: every role gets PS_AUTH_TOKEN_FILE=FILE (made absolute), so "
        "pservers refuse calls without the token in FILE and trainers send it. PS_AUTH_TOKEN "
        "and PS_TLS_* set for ps-launch reach every role as they are",
    )
    _add(
        p,
        "--tensorboard_dir",
        metavar="DIR",
        help="TensorBoard: every role gets PS_TENSORBOARD_DIR=DIR (made absolute); trainer 0 writes its "
        "scalars and the pservers' under DIR/trainer-0 (PS_TENSORBOARD_TRAINERS=all: every trainer, "
        "DIR/trainer-N); "
        "needs the tensorboard package (docs/tensorboard.md)",
    )
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
            return argv[:i], argv[i + 1 :]
        if not token.startswith("-") or token == "-":
            return argv[:i], argv[i:]
        i += 2 if token in takes_value else 1
    return argv, []


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the command line; argparse errors (and a missing SCRIPT) exit with code 2.

    ``log_level`` is the flag's, else ``$PS_LOG_LEVEL``'s, else INFO;
    ``log_level_given`` says whether the flag was there (then the roles get it too).
    """
    parser = build_parser()
    own, rest = split_argv(parser, sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(own)
    if not rest:
        parser.error("no SCRIPT given: ps-launch [options] SCRIPT [script args...]")
    args.script, args.script_args = rest[0], rest[1:]
    args.log_level_given = args.log_level is not None
    if args.log_level is None:
        try:
            args.log_level = log_level(os.environ.get(LOG_LEVEL_VAR) or "INFO")
        except argparse.ArgumentTypeError as e:
            parser.error(f"{LOG_LEVEL_VAR}: {e}")
    args.log_level_number = logging.getLevelName(args.log_level)
    return args
