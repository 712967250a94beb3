"""Whether ps-launch restarts a role that ended: a pure decision, and how an exit status reads.

The supervisor (supervisor) asks :func:`decide_restart` about each role
that ended and does what it answers; nothing here touches a process.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

from transpiler.roles.role_env import PSERVER

FINISHED = "finished"  # exit 0: the role is done (a trainer's data ran out, a pserver saw every Close)
RESTART = "restart"  # start the same command again, same role id and variables
STOP = "stop"  # the job fails: stop every other role, exit 1


@dataclass(frozen=True)
class RestartDecision:
    """What to do about one ended role, and the words that say why (for the console and the log)."""

    action: str
    reason: str


def exit_reason(returncode: int) -> str:
    """``exited with code N`` or ``was killed by SIGNAME`` (a Popen returncode: -N is signal N)."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        return f"was killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"was killed by signal {-returncode}"


def decide_restart(
    kind: str, returncode: int, restarts_used: int, max_restarts: int, trainers_done: bool = False
) -> RestartDecision:
    """What to do about a role of ``kind`` (PSERVER/TRAINER) that ended with ``returncode``.

    Exit 0 is FINISHED. Any other end (a non-zero code, or a signal: negative)
    is a death: RESTART while the role's unit has used fewer than
    ``max_restarts`` restarts, else STOP. A pserver that dies once this host's
    trainers have all finished (``trainers_done``) is not restarted: nobody is
    left to resume with it, so its death fails the job as without restarts.
    The reason names the exit status and, for STOP after restarts, the budget.
    """
    if returncode == 0:
        return RestartDecision(FINISHED, "exited with code 0")
    why = exit_reason(returncode)
    if max_restarts <= 0:
        return RestartDecision(STOP, why)
    if kind == PSERVER and trainers_done:
        return RestartDecision(STOP, f"{why} after every trainer had finished (not restarted)")
    if restarts_used >= max_restarts:
        return RestartDecision(STOP, f"{why} with no restarts left ({restarts_used} of {max_restarts} used)")
    return RestartDecision(RESTART, f"{why}; restart {restarts_used + 1} of {max_restarts}")
