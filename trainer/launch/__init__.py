"""ps-launch: start and supervise the pservers and trainers of a job (usage: args.DESCRIPTION).

``main`` plans the roles (plan), starts each in its own session with
its log file (procs), prints the role table, copies the chosen roles'
output to the console (console), supervises and restarts them
(supervisor) and stops them all.
"""

from __future__ import annotations

import logging
import os
from typing import List, Optional, Sequence

from transpiler.roles.role_env import PSERVER, TRAINER

from .arg_checks import LaunchError
from .args import parse_args
from .console import Console, ConsoleCopier, ConsoleHandler, shown_roles
from .plan import plan_roles

# The process and supervision pieces stay importable from here (tests and tools use launch.X).
from .procs import StopSignals, role_command, start_roles, stop_roles, tail, write_roles_file  # noqa: F401
from .role import Role
from .supervisor import supervise  # noqa: F401

log = logging.getLogger("ps-launch")


def _place(role: Role) -> str:
    if role.kind == PSERVER:
        return role.endpoint
    if role.local_world_size == 1 and "WORLD_SIZE" not in role.env:
        return f"trainer {role.index} on {role.host}"
    where = f"trainer node {role.index} local rank {role.local_rank}/{role.local_world_size}"
    if "PADDLE_PSERVERS_IP_PORT_LIST" not in role.env:  # collective: one group of the whole job
        where += f" rank {role.env['RANK']}/{role.env['WORLD_SIZE']}"
    return f"{where} on {role.host}"


def format_table(roles: List[Role]) -> str:
    """The table printed at start: role, index, endpoint or trainer node (and local rank), pid, log file."""
    rows = [("ROLE", "INDEX", "ENDPOINT / TRAINER ID", "PID", "LOG")]
    for r in roles:
        where = _place(r)
        rows.append((r.kind, str(r.index), where, str(r.proc.pid) if r.proc else "-", r.log_path or "-"))
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows)


def _console_logging(console: Console, level: int) -> ConsoleHandler:
    """Route the launcher's logger ("ps-launch") to ``console`` at ``level``; returns the handler to
    remove."""
    handler = ConsoleHandler(console)
    log.addHandler(handler)
    log.setLevel(level)
    log.propagate = False
    return handler


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``ps-launch``: plan, start, print the table, supervise, return the exit code."""
    args = parse_args(argv)
    console = Console()
    handler = _console_logging(console, args.log_level_number)
    try:
        return _run(args, console)
    finally:
        console.close()
        log.removeHandler(handler)
        log.propagate = True


def _run(args, console: Console) -> int:
    try:
        roles = plan_roles(args)
        os.makedirs(args.log_dir, exist_ok=True)
    except (LaunchError, OSError) as e:  # bad input is always reported, whatever --log_level says
        console.launcher(f"ps-launch: error: {e}", error=True)
        return 2
    with StopSignals() as stops:
        try:
            start_roles(roles, args.script, args.script_args, args.log_dir)
        except OSError as e:  # start_roles has stopped the roles it did start
            console.launcher(f"ps-launch: error: cannot start the roles: {e}", error=True)
            return 2
        copier = ConsoleCopier(console, shown_roles(roles, args.show))
        try:
            write_roles_file(args.log_dir, roles)
            if log.isEnabledFor(logging.INFO):
                console.launcher(format_table(roles))
            local_nodes = len({r.index for r in roles if r.kind == TRAINER})
            all_trainers_here = local_nodes == int(roles[0].env["PADDLE_TRAINERS_NUM"])
            grace = args.server_grace if all_trainers_here else None
            return supervise(
                roles,
                grace,
                args.term_timeout,
                stops,
                max_restarts=args.max_restarts,
                tick=copier.pump,
                on_restart=lambda: write_roles_file(args.log_dir, roles),
            )
        finally:
            # Whatever went wrong above (even in the launcher itself), no role outlives it.
            stop_roles(roles, timeout=args.term_timeout)
            copier.drain()
            write_roles_file(args.log_dir, roles)
