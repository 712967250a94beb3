"""Recovery I/O: ask the pservers, let :mod:`trainer.recovery.decide` choose, act on the decision.

A pserver that is briefly unreachable, restarted from a checkpoint, or that
dropped this trainer for silence answers UNAVAILABLE or ABORTED (CANCELLED
while it shuts down). The trainer then waits for every pserver (``Hello``,
with gRPC's reconnect backoff, up to ``recovery_timeout``), rolls sync
pservers back to a restarted one's checkpoint (``Restore``, once per restart)
and goes on where the decision says.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING, Callable, Dict, Mapping, Optional, Sequence, Set

from transpiler.position import Position

from ..errors import REFUSED, PserverError
from . import decide
from .decide import FAIL, RESTORE, RETRY, SKIP, WAIT, Decision, PserverState

if TYPE_CHECKING:  # the channels are handed in; recovery decides on trainer.errors' kinds, not on the wire
    from ..transport import Channels

log = logging.getLogger(__name__)


def states(replies: Mapping[str, object]) -> Dict[str, PserverState]:
    """The :class:`PserverState` of each pserver's ``HelloReply``."""
    return {
        ep: PserverState(
            r.incarnation,
            r.start_step,
            r.checkpoint_step,
            Position(r.epoch, r.batch),
            r.counted_step,
            r.applied_step if r.sync_mode else None,
            r.others_in_step,
        )
        for ep, r in replies.items()
    }


def recoverable(error: BaseException) -> bool:
    """Whether ``error`` (from a step's calls) may heal by waiting and re-syncing."""
    return isinstance(error, PserverError) and decide.recoverable(error.kind)


class Recovery:
    """A trainer's joins and re-syncs: the I/O around :mod:`~trainer.recovery.decide`.

    Keeps the incarnation of every pserver as last seen, so a restart shows as
    a new one. ``join`` registers with every pserver; ``heal`` runs a step's
    calls and re-syncs on a recoverable failure. ``new_layout``: the pservers
    are those of a layout the trainer has just adopted, whose restarts since
    the commit its join cannot tell (:func:`~trainer.recovery.decide.restarts_unseen`).
    """

    def __init__(
        self,
        channels: "Channels",
        sync_mode: bool,
        push_endpoints: Sequence[str],
        connect_timeout: float,
        recovery_timeout: float,
        new_layout: bool = False,
    ):
        self.channels = channels
        self.new_layout = new_layout
        self.sync_mode = sync_mode
        self.push_endpoints = list(push_endpoints)
        self.connect_timeout = connect_timeout
        self.recovery_timeout = recovery_timeout
        self.incarnations: Dict[str, int] = {}

    def join(self) -> Decision:
        """Register with every pserver; the JOIN decision says at which step and data position.

        Waits ``connect_timeout`` for the pservers to come up; sync pservers at
        different steps are rolled back to the checkpoint those behind stand at
        (RESTORE), or asked again, backing off, within ``recovery_timeout``.
        """
        timeout, backoff, join_at = self.connect_timeout, 0.1, 0
        deadline = time.monotonic() + self.recovery_timeout
        restored: Set[str] = set()
        tid = self.channels.trainer_id
        while True:
            answers = states(self.channels.hello(timeout, join_at=join_at))
            time_left = deadline - time.monotonic()
            decision = decide.on_join(
                self.sync_mode, answers, self.push_endpoints, time_left, restored, self.new_layout
            )
            if decision.action == FAIL:
                raise PserverError(", ".join(decision.endpoints), decision.message)
            if decision.action == RESTORE:
                # A layout's pservers told of each other's starts (decision.restarted): routine, each adopt.
                level = logging.INFO if decision.restarted else logging.WARNING
                log.log(level, "trainer %d: %s; rolling every pserver back to it", tid, decision.message)
                if self._restore_or_ask_again(decision, deadline):
                    restored.update(token for _, token in decision.restores)
                join_at = 0  # after a roll-back every trainer starts at the checkpoint's step
                continue
            if decision.action != WAIT:
                self.incarnations = {ep: a.incarnation for ep, a in answers.items()}
                return decision
            join_at = decision.step
            remaining = deadline - time.monotonic()
            log.warning(
                "trainer %d: %s; asking again (joining at step %d) for up to %.0fs",
                tid,
                decision.message,
                join_at,
                remaining,
            )
            # Hello waits for a pserver that is down, not for one that disagrees: back off.
            time.sleep(max(0.0, min(backoff, remaining)))
            backoff = min(2 * backoff, 2.0)
            timeout = max(0.1, deadline - time.monotonic())

    def heal(
        self, step: int, what: str, calls: Callable[[], object], pull: Callable[[int], object]
    ) -> Optional[Decision]:
        """Run ``calls`` (``what``, at ``step``); on a failure that can heal, re-sync and go on.

        ``calls`` is retried (pushes are idempotent) until it goes through
        (None), or the decision says where to go on from instead (SKIP or
        ROLLBACK): then ``pull(step)`` fetches the parameters of that step
        before the decision is returned. Every part of it (Hello, Restore,
        the pull) is retried through failures that can heal, within
        ``recovery_timeout`` of the first.
        """
        deadline, moved = None, None
        while True:
            try:
                if moved is None:
                    calls()
                    return None
                pull(moved.step)
                return moved
            except PserverError as e:
                if not recoverable(e):
                    raise
                if deadline is None:
                    deadline = time.monotonic() + self.recovery_timeout
                decision = self.resync(e, step if moved is None else moved.step, deadline, what)
                if decision.action != RETRY:
                    moved = decision

    def resync(self, failure: PserverError, step: int, deadline: float, what: str) -> Decision:
        """Wait for every pserver until ``deadline`` (monotonic) and decide how ``step`` goes on.

        Raises :class:`PserverError` when a pserver stays away past the
        deadline, or restarted without a checkpoint (its parameters are lost).
        """
        tid = self.channels.trainer_id
        log.warning(
            "trainer %d: %s failed (%s); waiting up to %.0fs for the pservers",
            tid,
            what,
            failure,
            max(0.0, deadline - time.monotonic()),
        )
        known, join_at = self.incarnations, 0
        while True:
            answers = states(self.channels.hello(max(0.1, deadline - time.monotonic()), join_at=join_at))
            decision = decide.after_failure(self.sync_mode, known, step, answers, self.push_endpoints)
            for ep in decision.restarted:
                log.warning(
                    "trainer %d: pserver %s restarted (from the checkpoint at step %d)",
                    tid,
                    ep,
                    answers[ep].checkpoint_step,
                )
            if decision.action == FAIL:
                raise PserverError(", ".join(decision.endpoints), decision.message, REFUSED)
            if decision.action == RESTORE:
                join_at = 0  # after a roll-back every trainer redoes the checkpoint's step, this one too
                if self._restore_or_ask_again(decision, deadline):
                    self.incarnations = known = {ep: a.incarnation for ep, a in answers.items()}
                # Interrupted, ``known`` stays: its restarts are no news to the next answers, yet some pserver
                # has not heard of them; forgotten, another trainer's roll-back for one of them could reach
                # that pserver after it went on with this trainer, and roll it back behind this trainer's
                # back. Their answers predate the roll-back: ask again.
                continue
            self.incarnations = known = {ep: a.incarnation for ep, a in answers.items()}
            if decision.action == SKIP and decision.endpoints and join_at != decision.step:
                # A pserver a step behind waits for this trainer's push of a step it skips: say
                # where it starts (it then finishes that step without it), and decide on the answers.
                log.warning(
                    "trainer %d: %s a step behind the other pservers; telling them this trainer "
                    "rejoins at step %d",
                    tid,
                    ", ".join(decision.endpoints),
                    decision.step,
                )
                join_at = decision.step
                continue
            break
        _log_decision(tid, decision, step)
        return decision

    def _restore_or_ask_again(self, decision: Decision, deadline: float) -> bool:
        """Roll ``decision.endpoints`` back to the checkpoint at ``decision.step``, in parallel, each with
        its tokens.

        Returns whether every pserver answered. A pserver lost meanwhile fails the roll-back in a way that
        can heal (False): the caller asks everyone again, and its restart is a new decision, until
        ``deadline``.
        """

        def restore(ep: str) -> None:
            for token in decision.tokens_for(ep):
                self.channels[ep].restore(decision.step, token)

        try:
            self.channels.run_parallel({ep: functools.partial(restore, ep) for ep in decision.endpoints})
            return True
        except PserverError as e:
            if not recoverable(e) or time.monotonic() > deadline:
                raise
            log.warning(
                "trainer %d: roll-back to step %d interrupted (%s); asking the pservers again",
                self.channels.trainer_id,
                decision.step,
                e,
            )
            return False


def _log_decision(trainer_id: int, decision: Decision, step: int) -> None:
    if decision.action == decide.SKIP:
        log.warning(
            "trainer %d: the other trainers went on without this one (dropped after "
            "heartbeat_timeout?); rejoining at step %d",
            trainer_id,
            decision.step,
        )
    elif decision.action == decide.ROLLBACK:
        log.warning(
            "trainer %d: every pserver is back at the checkpoint of step %d; steps %d..%d are "
            "redone from data position epoch %d batch %d",
            trainer_id,
            decision.step,
            decision.step,
            step,
            *decision.position,
        )
    else:
        log.info("trainer %d: pservers are back; retrying step %d", trainer_id, step)
