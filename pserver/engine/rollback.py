"""RollBacks: a pserver's checkpoints as its engine uses them, and the roll-backs it made.

:class:`RollBacks` is a part of :class:`~pserver.engine.engine.Engine`, built by
it from the ``checkpointer`` over its roster, its step in progress and its
listeners, and called under the engine's lock. It holds which roll-back tokens
were honoured, how many roll-backs were made (a change wakes every wait of the
abandoned steps with :class:`~pserver.errors.MustResync`), the roll-backs each
trainer's last Hello saw, and the checkpoint this pserver started from or
rolled back to. It decides what a roll-back asked with a token does
(:meth:`RollBacks.roll_back`), loads the checkpoint and resets the trainers
and the step in progress to it, telling the listeners; the engine takes the
step it returns. A backup's copy of its primary's state is taken the same
way (:meth:`RollBacks.follow`). Beside the checkpoints it records at once
which trainers closed, and deletes the parts a roll-back abandoned.
Checkpoints written every ``checkpoint_every`` updates are a listener's
(:class:`~pserver.engine.listeners.ScheduledCheckpoints`).
"""

from __future__ import annotations

import enum
import logging
from typing import Dict, Optional, Sequence, Tuple

from ..checkpoint import Checkpointer
from ..errors import MustResync, NotAllowed, Refusal, StorageFailed
from .listeners import UpdateListener
from .pending import PendingStep
from .roster import Roster

log = logging.getLogger(__name__)


class RollBack(enum.Enum):
    """What a roll-back asked with a token does."""

    HONOURED = "honoured"  # the token was honoured before: nothing
    STAYS = "stays"  # this pserver stands unchanged at that very checkpoint: the pushes counted are kept
    LOADED = "loaded"  # the checkpoint was loaded and the state reset to it


class RollBacks:
    """Checkpoints on demand, resume, and roll-backs honoured once per token (sync recovery).

    ``roster``, ``pending`` (the sync step in progress; None: async) and ``listeners`` are the engine's.
    """

    def __init__(
        self,
        checkpointer: Optional[Checkpointer],
        endpoint: str,
        roster: Roster,
        pending: Optional[PendingStep] = None,
        listeners: Sequence[UpdateListener] = (),
    ):
        self.checkpointer = checkpointer
        self.endpoint = endpoint
        self.roster = roster
        self.pending = pending
        self.listeners = tuple(listeners)
        # The checkpoint this process started from, rolled back to, or (hot standby) its primary's; -1: none.
        self.restored_from = -1
        self.made = 0  # roll-backs made: a change wakes the waits of the abandoned steps
        self._honoured: set = set()
        # Per trainer, the roll-backs counted at its last Hello: a wait from before the latest one
        # belongs to an abandoned timeline (see refuse_wait_from_before_a_roll_back).
        self._hello_rollbacks: Dict[int, int] = {}

    def checkpoint(self, pserver_step: int) -> Tuple[int, str]:
        """Write a checkpoint at ``pserver_step`` now; (its step, part directory).

        Refused (:class:`NotAllowed`) without a checkpoint_dir; a file system
        error is :class:`StorageFailed`.
        """
        if self.checkpointer is None:
            raise NotAllowed(f"pserver {self.endpoint} has no checkpoint_dir configured")
        try:
            return pserver_step, self.checkpointer.save(pserver_step, self.roster.to_meta())
        except OSError as e:
            raise StorageFailed(f"pserver {self.endpoint}: checkpoint failed: {e}") from None

    def resume(self, step: Optional[int] = None) -> Optional[int]:
        """Load the latest complete checkpoint (or the one at ``step``) and reset to it; its step, or None if
        there is none."""
        meta = self.checkpointer.load(step)
        return None if meta is None else self._reset(meta)

    def check_can_roll_back(self) -> None:
        """:class:`NotAllowed` without a checkpoint_dir."""
        if self.checkpointer is None:
            raise NotAllowed(f"pserver {self.endpoint} has no checkpoint_dir to roll back from")

    def roll_back(
        self, trainer_id: int, step: int, token: str, pserver_step: int
    ) -> Tuple[RollBack, Optional[int]]:
        """What a roll-back to the checkpoint at ``step`` asked with ``token`` does at ``pserver_step``; the
        pserver's step after it, if it changed.

        :class:`RollBack.STAYS` when this pserver stands unchanged at that very checkpoint (loaded from it,
        nothing applied since): the pushes counted for the step are valid and kept, since a late roll-back,
        asked for a restart other trainers have already re-synced past, must not discard them.
        :class:`RollBack.LOADED` has loaded the checkpoint into the blocks and tables and reset the rest of
        the state to it (:meth:`resume`'s reset). Without a complete checkpoint at ``step``:
        :class:`NotAllowed`; one that cannot be read or does not fit: :class:`StorageFailed`, and nothing
        changes. The token counts as honoured unless it raised.
        """
        if token in self._honoured:
            return RollBack.HONOURED, None
        if self.restored_from == step == pserver_step:
            self._honoured.add(token)
            log.info(
                "%s: already at the checkpoint of step %d, nothing applied since; roll-back asked "
                "by trainer %d (%s) keeps the pushes counted for it",
                self.endpoint,
                step,
                trainer_id,
                token,
            )
            return RollBack.STAYS, None
        try:
            meta = self.checkpointer.load(step)
        except (OSError, ValueError) as e:  # load's contract: unreadable or unfit, nothing changed
            raise StorageFailed(f"pserver {self.endpoint}: cannot roll back to step {step}: {e}") from None
        if meta is None:
            raise NotAllowed(
                f"pserver {self.endpoint}: no complete checkpoint at step {step} "
                f"to roll back to (asked by trainer {trainer_id})"
            )
        log.warning(
            "%s: rolled back from step %d to the checkpoint at step %d (asked by trainer %d "
            "after pservers restarted: %s)",
            self.endpoint,
            pserver_step,
            step,
            trainer_id,
            token,
        )
        self._honoured.add(token)
        return RollBack.LOADED, self._reset(meta)

    def _reset(self, meta: dict) -> int:
        """Take the trainers from a loaded checkpoint's manifest (blocks and tables are loaded); its step.

        The step in progress is abandoned, and this pserver's parts newer than the checkpoint.
        """
        step = int(meta["step"])
        self.roster.load_meta(meta)
        if self.pending is not None:
            self.pending.clear()
            self.pending.forget_joins()
        self.restored_from = step
        if self.checkpointer is not None:
            self.checkpointer.forget_after(step)
        for listener in self.listeners:
            listener.on_reset(step)
        return step

    def follow(self, meta: dict, checkpoint_step: int) -> int:
        """Backup: take the roster of the primary's state copy just loaded into the blocks and tables; its
        step.

        That state stands on the primary's checkpoint at ``checkpoint_step`` (-1: none).
        """
        self.roster.follow(meta)
        if self.pending is not None:
            self.pending.clear()
        self.restored_from = checkpoint_step
        return int(meta["step"])

    def note_closed(self, closed) -> None:
        """Record at once which trainers have closed, beside the checkpoints (a restart from one expects
        them not)."""
        if self.checkpointer is not None:
            self.checkpointer.note_closed(closed)

    def abandon_timeline(self) -> None:
        """The steps after the checkpoint are abandoned: every wait begun before ends with MustResync."""
        self.made += 1

    def hello(self, trainer_id: int) -> None:
        """Note the roll-backs ``trainer_id``'s Hello saw."""
        self._hello_rollbacks[trainer_id] = self.made

    def refusal_ahead(self, trainer_id: int, what: str, target: int, pserver_step: int) -> Refusal:
        """The refusal of a push or wait for ``target``, beyond the step after ``pserver_step``."""
        if self.restored_from >= 0:
            # This pserver restarted or rolled back to a checkpoint: the trainer must re-sync.
            return MustResync(
                f"pserver {self.endpoint}: trainer {trainer_id} {what} {target}, but this "
                f"pserver resumed from the checkpoint at step {self.restored_from} and "
                f"is at step {pserver_step}; call Hello to re-sync"
            )
        return NotAllowed(
            f"pserver {self.endpoint}: trainer {trainer_id} {what} {target} from the "
            f"future; the pserver is at step {pserver_step} and can only reach {pserver_step + 1} next"
        )

    def refuse_wait_from_before_a_roll_back(self, trainer_id: int, what: str) -> None:
        """MustResync for a trainer that said Hello before this pserver's latest roll-back and would wait.

        The caller checked that the step waited for needs this trainer's own
        push: a trainer still on the abandoned timeline would wait for it
        until the barrier deadline. (One whose push for the step was counted
        waits as usual.)
        """
        if self._hello_rollbacks.get(trainer_id, self.made) != self.made:
            raise MustResync(
                f"pserver {self.endpoint}: rolled back to the checkpoint at step "
                f"{self.restored_from} since trainer {trainer_id} said Hello; its {what} "
                f"belongs to the steps abandoned; call Hello to re-sync"
            )
