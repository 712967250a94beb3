"""Recovery decisions: pure functions from what the pservers answered to what a trainer does next.

Nothing here does I/O; :mod:`trainer.recovery.healer` asks the pservers and
acts. The decisions, by what the pservers said at ``Hello``:

=====================================================  ============================================
what the pservers answered                             decision
=====================================================  ============================================
a call failed with UNAVAILABLE, ABORTED or CANCELLED   recoverable: wait for the pservers, re-sync
any other status                                       not recoverable: the error reaches the user
a pserver restarted without a checkpoint               FAIL: its parameters are lost
sync, a pserver restarted from checkpoint *c*          RESTORE: roll every other pserver back to *c*
sync, pservers ahead without this trainer's push       SKIP to their highest step (it was dropped);
                                                       one a step behind is told (Hello join_at) and
                                                       finishes its step without this trainer
sync, the pservers are behind this trainer's step      ROLLBACK to their step and data position
otherwise (async restarts included)                    RETRY the same step (pushes are idempotent)
joining: sync pservers at different steps              WAIT and ask again, saying the highest step
                                                       (one behind then finishes its step without it)
joining: still different at the deadline               FAIL: restart every pserver
joining: otherwise                                     JOIN at their step and data position
=====================================================  ============================================
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Sequence, Tuple

import grpc

Position = Tuple[int, int]

# CANCELLED: what a call in flight gets from a pserver that is shutting down (SIGTERM, a restart).
RECOVERABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED})

RETRY, SKIP, ROLLBACK, RESTORE, FAIL, WAIT, JOIN = "retry", "skip", "rollback", "restore", "fail", "wait", "join"

LOST_MESSAGE = ("restarted without a checkpoint, so the parameters it held are lost; set checkpoint_dir "
                "to survive pserver restarts")
RESTART_ALL = ("if one restarted while no trainer was alive to roll the others back, restart them all: "
               "they resume from the latest complete checkpoint")


@dataclass(frozen=True)
class PserverState:
    """What one pserver answered at ``Hello``: who it is, where it stands, where it restarted from.

    ``step`` is where this trainer (re)starts on it (sync: the pserver's step;
    async: this trainer's own next step); ``checkpoint_step`` is the checkpoint
    the pserver process started from (-1: none); ``position`` is this
    trainer's data position as last pushed or checkpointed; ``counted`` is the
    last step of this trainer the pserver counted (-1: none).
    """

    incarnation: int
    step: int
    checkpoint_step: int = -1
    position: Position = (0, 0)
    counted: int = -1


@dataclass(frozen=True)
class Decision:
    """What to do next: ``action`` (one of the constants above) and what it needs.

    RESTORE: roll ``endpoints`` back to the checkpoint at ``step``, once per
    ``token``. SKIP / ROLLBACK / JOIN: go on at ``step`` (ROLLBACK and JOIN from
    data ``position``); SKIP's ``endpoints`` stand behind ``step`` and must be
    told (Hello with ``join_at=step``) before the trainer goes on. FAIL:
    ``endpoints`` and ``message`` say why. ``restarted`` lists the pservers
    whose process changed since the trainer last asked.
    """

    action: str
    step: int = 0
    position: Position = (0, 0)
    endpoints: Tuple[str, ...] = ()
    token: str = ""
    message: str = ""
    restarted: Tuple[str, ...] = ()


def recoverable(code: Optional[grpc.StatusCode]) -> bool:
    """Whether a call that failed with status ``code`` may heal by waiting and re-syncing."""
    return code in RECOVERABLE


def restarted(known: Mapping[str, int], answers: Mapping[str, PserverState]) -> Tuple[str, ...]:
    """The pservers whose incarnation differs from the one the trainer knew: they restarted."""
    return tuple(sorted(ep for ep, a in answers.items() if a.incarnation != known.get(ep)))


def after_failure(sync_mode: bool, known: Mapping[str, int], step: int,
                  answers: Mapping[str, PserverState], push_endpoints: Sequence[str]) -> Decision:
    """How step ``step`` goes on after a recoverable failure, given every pserver's ``answers``.

    ``known`` holds the incarnations the trainer saw before the failure. After
    a RESTORE the caller asks the pservers again and decides anew with the
    incarnations it restored for as ``known``.
    """
    gone = restarted(known, answers)
    lost = tuple(ep for ep in gone if answers[ep].checkpoint_step < 0)
    if lost:
        return Decision(FAIL, step, endpoints=lost, message=LOST_MESSAGE, restarted=gone)
    if gone and sync_mode:
        # Every pserver goes back to the restarted ones' (earliest) checkpoint.
        target = min(answers[ep].checkpoint_step for ep in gone)
        others = tuple(ep for ep in answers if ep not in gone or answers[ep].checkpoint_step != target)
        if others:
            token = ",".join(f"{ep}#{answers[ep].incarnation}" for ep in gone)
            return Decision(RESTORE, target, endpoints=others, token=token, restarted=gone)
    steps = {ep: answers[ep].step for ep in push_endpoints} if sync_mode else {}
    ahead = [ep for ep in steps if steps[ep] > step]
    if ahead and all(answers[ep].counted < step for ep in ahead):
        # The others went on without this trainer (dropped after heartbeat_timeout). A pserver
        # ahead that counted this trainer's push went on with it: after overlapping restarts the
        # others may still need that push, so the step is retried (a duplicate is acknowledged).
        # Pservers that dropped it at different moments may stand a step apart, the one behind
        # waiting for this trainer's push of its step: ``endpoints`` are those to tell it joins later.
        target = max(steps.values())
        behind = tuple(sorted(ep for ep in steps if steps[ep] < target))
        return Decision(SKIP, target, endpoints=behind, restarted=gone)
    if steps and min(steps.values()) < step:
        # Rolled back to a checkpoint, on this trainer's request or another's.
        source = min(steps, key=steps.get)
        return Decision(ROLLBACK, steps[source], answers[source].position, restarted=gone)
    return Decision(RETRY, step, restarted=gone)


def on_join(sync_mode: bool, answers: Mapping[str, PserverState], push_endpoints: Sequence[str],
            time_left: float) -> Decision:
    """Whether a joining trainer can start, given every pserver's ``answers`` and the time left.

    Sync pservers must agree on the step: apart, they are mid-step or a
    roll-back is under way (WAIT at the highest step: asked again with it as
    ``join_at``, a pserver one step behind goes on without this trainer), unless
    the deadline has passed (FAIL).
    """
    steps: Dict[str, int] = {ep: a.step for ep, a in answers.items() if ep in push_endpoints}
    if sync_mode and len(set(steps.values())) > 1:
        if time_left <= 0:
            return Decision(FAIL, endpoints=tuple(steps),
                            message=f"pservers disagree on the current step: {steps}; {RESTART_ALL}")
        return Decision(WAIT, max(steps.values()), endpoints=tuple(steps),
                        message=f"pservers disagree on the current step: {steps}")
    first = answers[push_endpoints[0]] if push_endpoints else None
    return Decision(JOIN, max(steps.values(), default=0), first.position if first is not None else (0, 0))
