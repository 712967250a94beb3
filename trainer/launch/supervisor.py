"""Supervising a ps-launch job: watch the roles, restart the ones that die (--max_restarts), end the job.

The decisions are restart's (pure); this module only acts on them.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Callable, List, Optional

from transpiler.roles.role_env import PSERVER, TRAINER

from .procs import POLL_INTERVAL, StopSignals, exit_text, start_role, stop_roles, tail
from .restart import RESTART, STOP, RestartDecision, decide_restart
from .role import Role

log = logging.getLogger("ps-launch")


def _fail(first: Role, reason: str, others: List[Role]) -> None:
    also = "".join(f"\nps-launch: {r.title} {exit_text(r)} too" for r in others)
    node = (
        f" (the other local ranks of trainer node {first.index} among them)"
        if first.kind == TRAINER and first.local_world_size > 1
        else ""
    )
    log.error(
        "%s %s; stopped every other role%s%s\nps-launch: last lines of %s:\n%s",
        first.title,
        reason,
        node,
        also,
        first.log_path,
        tail(first.log_path),
    )


def supervise(
    roles: List[Role],
    server_grace: Optional[float] = 30.0,
    term_timeout: float = 10.0,
    stops: Optional[StopSignals] = None,
    max_restarts: int = 0,
    tick: Callable[[], None] = lambda: None,
    on_restart: Callable[[], None] = lambda: None,
) -> int:
    """Wait for the started roles, restart the ones that die, stop them all; return the launcher's exit code.

    A role is one process; a trainer node of several processes is several roles
    but one *unit*: it stops and restarts as a whole. Trainers all exiting 0 is
    success (0): pservers then get ``server_grace`` s to exit by themselves before
    being stopped (None: wait for them, as when trainers on other hosts still use
    them; pservers exit once every trainer of the job has closed). A role that
    dies (non-zero exit, or a signal) is started again, same command and
    variables, while its unit has restarts left (``max_restarts`` each, see
    :func:`restart.decide_restart`); ``on_restart()`` runs after each.
    Otherwise its death fails the job (1): the others are stopped (a failed trainer
    node's other processes among them, which would wait in its collectives) and
    the failure is reported, naming the node and local rank, with its log's tail.
    A signal counted in ``stops`` stops every role (128 + signal number); one
    arriving while roles are being stopped cuts their SIGTERM grace short.
    ``tick()`` runs every poll (the console copies the roles' output).
    """
    stops = stops or StopSignals()
    trainers = [r for r in roles if r.kind == TRAINER]
    servers = [r for r in roles if r.kind == PSERVER]

    def stop(which: List[Role]) -> List[Role]:
        seen = stops.count
        return stop_roles(which, term_timeout, hurry=lambda: stops.count > seen, tick=tick)

    def restart(first: Role, decision: RestartDecision) -> bool:
        unit = [r for r in roles if r.unit == first.unit]
        what = first.title
        stop([r for r in unit if r.alive])  # a node's other local ranks: their collectives broke
        if stops.count:
            return True  # the loop stops the job
        used = first.restarts + 1
        try:
            for role in unit:
                role.restarts = used
                start_role(role, note=f"{what} {decision.reason}")
        except OSError as e:
            log.error("cannot restart %s: %s; stopping every role", what, e)
            return False
        pids = ", ".join(str(r.proc.pid) for r in unit)
        again = (
            f"trainer node {first.index} started again (pids {pids})"
            if len(unit) > 1
            else f"started again as pid {pids}"
        )
        log.warning("%s %s: %s", what, decision.reason, again)
        on_restart()
        return True

    grace_deadline = None
    while True:
        tick()
        if stops.count:
            log.warning("%s received; stopping %d roles", signal.Signals(stops.signum).name, len(roles))
            stop(roles)
            return 128 + stops.signum
        failed = [r for r in roles if r.proc.poll() not in (None, 0)]
        if failed:
            # A process killed by a signal is a cause, never a peer's consequence (those exit
            # with an error once a collective breaks): name it first.
            failed.sort(key=lambda r: r.proc.returncode >= 0)
            trainers_done = bool(trainers) and all(r.proc.returncode == 0 for r in trainers)
            decisions = {}
            for r in failed:
                if r.unit not in decisions:
                    decisions[r.unit] = (
                        r,
                        decide_restart(r.kind, r.proc.returncode, r.restarts, max_restarts, trainers_done),
                    )
            stopping = [(r, d) for r, d in decisions.values() if d.action == STOP]
            if stopping:
                first, decision = stopping[0]
                stop(roles)
                tick()
                _fail(first, decision.reason, [r for r in failed if r is not first])
                return 1
            for r, decision in decisions.values():
                assert decision.action == RESTART
                if not restart(r, decision):
                    stop(roles)
                    return 1
            continue
        if all(r.proc.returncode == 0 for r in trainers):
            live = [r for r in servers if r.alive]
            if not live:
                tick()
                log.info("all roles finished")
                return 0
            if not trainers or server_grace is None:
                pass  # pservers serve trainers elsewhere: they exit when those close
            elif grace_deadline is None:
                grace_deadline = time.monotonic() + server_grace
                log.info("all trainers finished; pservers get %g s to exit", server_grace)
            elif time.monotonic() >= grace_deadline:
                log.info("stopping %s after the grace period", ", ".join(r.name for r in live))
                for role in stop(live):
                    log.warning("warning: %s ignored SIGTERM and was killed", role.name)
                return 0
        time.sleep(POLL_INTERVAL)
