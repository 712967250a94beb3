"""Recovery decisions: pure functions from what the pservers answered to what a trainer does next.

Nothing here does I/O; :mod:`trainer.recovery.healer` asks the pservers and
acts. The decisions, by what the pservers said at ``Hello``:

=====================================================  ============================================
what the pservers answered                             decision
=====================================================  ============================================
a call failed: the pserver is DOWN or asks to RESYNC   recoverable: wait for the pservers, re-sync
any other kind (trainer/errors.py)                     not recoverable: the error reaches the user
a pserver restarted without a checkpoint               FAIL: its parameters are lost
sync, a pserver restarted from checkpoint *c*          RESTORE: roll every other pserver back to *c*,
(and applied nothing since)                            telling each every restart seen (its token)
sync, a pserver past the step the trainer would push   SKIP to their highest step (it was dropped);
(its own, or the lowest pserver's) went on without     those behind are told (Hello join_at) and
its push (even if another ahead counted it)            finish their step without this trainer
sync, the pservers are behind this trainer's step      ROLLBACK to their step and data position
otherwise (async restarts included)                    RETRY the same step (pushes are idempotent)
joining: sync pservers that never agree by themselves  RESTORE: roll every pserver back to the
(applied steps 2+ apart, or a step in progress that    checkpoint *c* those behind started from,
waits for nobody else: stalled)                        once per state of the pservers
joining: sync pservers a step apart mid-step, or the   WAIT and ask again, saying the highest step
roll-back already asked for                            (one behind then finishes its step without it)
joining: still apart at the deadline                   FAIL, naming the checkpoint that is missing
joining a layout just adopted (sync): pservers         RESTORE: tell every other pserver of each as
standing unchanged at the checkpoint they started      of a restart (its token, once): one that stands
from (any of them may have restarted unseen)           there unchanged keeps what it counted
joining: otherwise                                     JOIN at their step and data position
=====================================================  ============================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet, Dict, Mapping, Optional, Sequence, Tuple

from transpiler.position import Position

from ..errors import DOWN, RESYNC

# The kinds of failure (trainer/errors.py) that heal by waiting for the pservers and re-syncing.
RECOVERABLE = frozenset({DOWN, RESYNC})

RETRY, SKIP, ROLLBACK, RESTORE, FAIL, WAIT, JOIN = (
    "retry",
    "skip",
    "rollback",
    "restore",
    "fail",
    "wait",
    "join",
)

LOST_MESSAGE = (
    "restarted without a checkpoint, so the parameters it held are lost; set checkpoint_dir "
    "to survive pserver restarts"
)
NO_CHECKPOINT = (
    "without a checkpoint at that step to roll the others back to (no checkpoint_dir, or none "
    "complete yet); restart every pserver: each resumes from the latest complete checkpoint"
)


@dataclass(frozen=True)
class PserverState:
    """What one pserver answered at ``Hello``: who it is, where it stands, where it restarted from.

    ``step`` is where this trainer (re)starts on it (sync: the pserver's step;
    async: this trainer's own next step); ``checkpoint_step`` is the checkpoint
    the pserver process started from or was rolled back to (-1: none);
    ``position`` is this trainer's data position as last pushed or
    checkpointed; ``counted`` is the last step of this trainer the pserver
    counted (-1: none). Sync: ``applied`` is the steps the pserver applied
    (None: ``step``), less than ``step`` when this trainer joins after the step
    in progress, and ``others`` the other trainers in that step (counted or
    awaited): with none, it never completes.
    """

    incarnation: int
    step: int
    checkpoint_step: int = -1
    position: Position = Position(0, 0)
    counted: int = -1
    applied: Optional[int] = None
    others: int = 0

    @property
    def applied_step(self) -> int:
        return self.step if self.applied is None else self.applied

    @property
    def stalled(self) -> bool:
        """Sync: the step in progress waits for nobody but this trainer, which joins after it."""
        return self.applied_step < self.step and self.others == 0


@dataclass(frozen=True)
class Decision:
    """What to do next: ``action`` (one of the constants above) and what it needs.

    RESTORE: roll ``endpoints`` back to the checkpoint at ``step``: each gets
    the tokens ``restores`` pairs with it ((pserver, token), in order), and
    rolls back once per token. SKIP / ROLLBACK / JOIN: go on at ``step``
    (ROLLBACK and JOIN from data ``position``); SKIP's ``endpoints`` stand
    behind ``step`` and must be told (Hello with ``join_at=step``) before the
    trainer goes on. FAIL: ``endpoints`` and ``message`` say why. ``restarted``
    lists the pservers whose process changed since the trainer last asked.
    """

    action: str
    step: int = 0
    position: Position = Position(0, 0)
    endpoints: Tuple[str, ...] = ()
    restores: Tuple[Tuple[str, str], ...] = ()
    message: str = ""
    restarted: Tuple[str, ...] = ()

    def tokens_for(self, endpoint: str) -> Tuple[str, ...]:
        """The roll-back tokens ``endpoint`` is sent, in order."""
        return tuple(token for ep, token in self.restores if ep == endpoint)


def recoverable(kind: Optional[str]) -> bool:
    """Whether a call that failed with ``kind`` (trainer/errors.py) may heal by waiting and re-syncing."""
    return kind in RECOVERABLE


def restarted(known: Mapping[str, int], answers: Mapping[str, PserverState]) -> Tuple[str, ...]:
    """The pservers whose incarnation differs from the one the trainer knew: they restarted."""
    return tuple(sorted(ep for ep, a in answers.items() if a.incarnation != known.get(ep)))


def after_failure(
    sync_mode: bool,
    known: Mapping[str, int],
    step: int,
    answers: Mapping[str, PserverState],
    push_endpoints: Sequence[str],
) -> Decision:
    """How step ``step`` goes on after a recoverable failure, given every pserver's ``answers``.

    ``known`` holds the incarnations the trainer saw before the failure. After
    a RESTORE that reached every pserver the caller asks the pservers again and
    decides anew with the incarnations it restored for as ``known``; after one
    interrupted (a pserver lost meanwhile), with the same ``known`` as before,
    so the restarts it was for are decided again, with any seen meanwhile.
    """
    gone = restarted(known, answers)
    lost = tuple(ep for ep in gone if answers[ep].checkpoint_step < 0)
    if lost:
        return Decision(FAIL, step, endpoints=lost, message=LOST_MESSAGE, restarted=gone)
    # A restarted pserver that applied steps since its checkpoint was re-synced with by the trainers that
    # made them (they push only once the others are rolled back): when every restart seen is such, this
    # trainer, which was not needed for them (dropped for silence, or left out by backup trainers), rolls
    # nothing back and goes on where the pservers stand (the checkpoint may be gone by now: checkpoint_keep).
    behind = tuple(ep for ep in gone if answers[ep].applied_step <= answers[ep].checkpoint_step)
    if behind and sync_mode:
        # Every pserver goes back to the restarted ones' (earliest) checkpoint. Each restart has a token of
        # its own, sent to every other pserver, restarted ones too: one standing at the checkpoint unchanged
        # keeps what it counted but honours the token, so a trainer that saw only that restart, asking later
        # once the pserver has gone on with every trainer, rolls nothing back that the others already
        # re-synced past.
        target = min(answers[ep].checkpoint_step for ep in behind)
        restores = tuple(
            (ep, restart_token(r, answers[r].incarnation)) for ep in sorted(answers) for r in gone if r != ep
        )
        if restores:
            return Decision(
                RESTORE,
                target,
                endpoints=tuple(sorted({ep for ep, _ in restores})),
                restores=restores,
                restarted=gone,
            )
    steps = {ep: answers[ep].step for ep in push_endpoints} if sync_mode else {}
    # Where this trainer would push next: its own step, or the lowest pserver's after a roll-back.
    start = min(step, *steps.values()) if steps else step
    ahead = [ep for ep in steps if steps[ep] > start]
    if any(answers[ep].counted < start for ep in ahead):
        # A pserver went on past ``start`` without this trainer (dropped after heartbeat_timeout):
        # its push of ``start`` would be stale there, so the step can be neither retried nor redone,
        # even where another pserver counted it (that one went on with it). When none ahead lacks
        # it, the others may still need the push after overlapping restarts (retried: a duplicate is
        # acknowledged), or those ahead are being rolled back. Pservers that dropped it at
        # different moments may stand a step apart, the one behind waiting for this trainer's push
        # of its step: ``endpoints`` are those to tell it joins later.
        target = max(steps.values())
        behind = tuple(sorted(ep for ep in steps if steps[ep] < target))
        return Decision(SKIP, target, endpoints=behind, restarted=gone)
    if steps and min(steps.values()) < step:
        # Rolled back to a checkpoint, on this trainer's request or another's.
        source = min(steps, key=steps.get)
        return Decision(ROLLBACK, steps[source], answers[source].position, restarted=gone)
    return Decision(RETRY, step, restarted=gone)


def restart_token(endpoint: str, incarnation: int) -> str:
    """The token of a roll-back to the checkpoint pserver ``endpoint`` restarted from, as ``incarnation``.

    Every trainer that sees the same restart names it the same way, whichever
    other restarts it saw with it, so each pserver rolls back once for it
    however many trainers ask.
    """
    return f"{endpoint}#{incarnation}"


def join_token(answers: Mapping[str, PserverState], step: int) -> str:
    """The token of a joining trainer's roll-back to ``step``: every pserver's incarnation and progress.

    Trainers joining at once that find the pservers in the same state name it
    the same way (one roll-back); a new state is a new roll-back.
    """
    return f"join@{step}:" + ",".join(
        f"{ep}#{answers[ep].incarnation}@{answers[ep].applied_step}" for ep in sorted(answers)
    )


def on_join(
    sync_mode: bool,
    answers: Mapping[str, PserverState],
    push_endpoints: Sequence[str],
    time_left: float,
    restored: AbstractSet[str] = frozenset(),
    new_layout: bool = False,
) -> Decision:
    """Whether a joining trainer can start, given every pserver's ``answers`` and the time left.

    Sync pservers must agree on the step. Pservers that applied steps two or
    more apart, or one whose step in progress waits for nobody but this
    trainer (stalled), never agree by themselves: a pserver restarted while no
    trainer was alive to roll the others back. RESTORE every pserver to the
    checkpoint those behind (and stalled) started from, once per state
    (``restored``: tokens already asked for), if they have one. Apart by one
    step otherwise, they are mid-step: WAIT at the highest step (asked again
    with it as ``join_at``, a pserver one step behind finishes its step
    without this trainer). FAIL once the deadline has passed.

    ``new_layout``: the trainer joins a layout it has just adopted (:func:`restarts_unseen`), first.
    """
    steps: Dict[str, int] = {ep: a.step for ep, a in answers.items() if ep in push_endpoints}
    if sync_mode and new_layout:
        told = restarts_unseen(answers, restored)
        if told is not None:
            return told
    if not sync_mode or not steps:
        first = answers[push_endpoints[0]] if push_endpoints else None
        return Decision(JOIN, max(steps.values(), default=0), first.position if first is not None else (0, 0))
    applied = {ep: answers[ep].applied_step for ep in steps}
    stalled = [ep for ep in steps if answers[ep].stalled]
    low = min(applied.values())
    if len(set(steps.values())) == 1 and not stalled:
        first = answers[push_endpoints[0]]
        return Decision(JOIN, first.step, first.position)
    apart = f"pservers disagree on the current step: {steps}" + (
        f", {', '.join(stalled)} waiting for no other trainer" if stalled else ""
    )
    if max(applied.values()) - low >= 2 or stalled:
        behind = sorted(set(stalled) | {ep for ep in steps if applied[ep] == low})
        target = min(answers[ep].checkpoint_step for ep in behind)
        token = join_token(answers, target)
        if target >= 0 and token not in restored:
            return Decision(
                RESTORE,
                target,
                endpoints=tuple(sorted(answers)),
                restores=tuple((ep, token) for ep in sorted(answers)),
                message=f"{apart}; {', '.join(behind)} started from the checkpoint of step {target}",
            )
        if time_left <= 0:
            why = (
                f"still apart after rolling them back to the checkpoint at step {target}"
                if target >= 0
                else f"{', '.join(behind)} stand at step {low} {NO_CHECKPOINT}"
            )
            return Decision(FAIL, endpoints=tuple(steps), message=f"{apart}; {why}")
    elif time_left <= 0:
        return Decision(FAIL, endpoints=tuple(steps), message=f"{apart}; still apart at the deadline")
    return Decision(WAIT, max(steps.values()), endpoints=tuple(steps), message=apart)


def restarts_unseen(answers: Mapping[str, PserverState], restored: AbstractSet[str]) -> Optional[Decision]:
    """Sync, joining a layout just adopted: RESTORE every pserver with the restart token of each other
    that stands unchanged at the checkpoint it started from, not yet told (``restored``); None when none.

    Every pserver of a layout starts from the checkpoint of the switch step at the commit, and one may
    have restarted since from that same checkpoint: a trainer that joins it only now, with no incarnation
    from before, cannot tell that restart from the start. A trainer that adopted earlier saw it, and rolls
    the others back for it once its own call fails there; should this trainer's first step complete on
    one of them before that roll-back (with that trainer's push counted before the restart), the roll-back
    would undo a step this trainer has done, and each would wait for the other's push for ever
    (barrier_timeout). Told first, that pserver honours the token where it stands unchanged (keeping what
    it counted: the step completes as pushed), and the later roll-back for that restart rolls nothing
    back. Until this trainer pushes, no pserver of the layout can pass its checkpoint (its step needs
    this trainer), so the tokens roll nothing back; where none restarted they change nothing either.
    """
    starts = tuple(sorted(ep for ep, a in answers.items() if a.applied_step <= a.checkpoint_step))
    tokens = {r: restart_token(r, answers[r].incarnation) for r in starts}
    restores = tuple(
        (ep, tokens[r]) for ep in sorted(answers) for r in starts if r != ep and tokens[r] not in restored
    )
    if not restores:
        return None
    target = min(answers[ep].checkpoint_step for ep in starts)
    return Decision(
        RESTORE,
        target,
        endpoints=tuple(sorted({ep for ep, _ in restores})),
        restores=restores,
        message=(
            f"joining a layout just adopted: {', '.join(starts)} stand at the checkpoint of step "
            f"{target} they started from, restarted maybe (the others are told, once per restart)"
        ),
        restarted=starts,
    )
