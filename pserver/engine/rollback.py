"""RollBacks: a pserver's checkpoints as its engine uses them, and the roll-backs it made.

:class:`RollBacks` is a part of :class:`~pserver.engine.engine.Engine`, built by
it from the ``checkpointer``, and called under the engine's lock. It holds
which roll-back tokens were honoured, how many roll-backs were made (a change
wakes every wait of the abandoned steps with :class:`~pserver.errors.MustResync`),
the roll-backs each trainer's last Hello saw, and the checkpoint this pserver
started from or rolled back to. It decides what a roll-back asked with a
token does (:meth:`RollBacks.roll_back`) and loads the checkpoint; the engine
resets its own state from what was loaded. Beside the checkpoints it records
at once which trainers closed, and deletes the parts a roll-back abandoned.
Checkpoints written every ``checkpoint_every`` updates are a listener's
(:class:`~pserver.engine.listeners.ScheduledCheckpoints`).
"""

from __future__ import annotations

import enum
import logging
from typing import Dict, Optional, Tuple

from ..checkpoint import Checkpointer
from ..errors import MustResync, NotAllowed, Refusal, StorageFailed
from .roster import Roster

log = logging.getLogger(__name__)


class RollBack(enum.Enum):
    """What a roll-back asked with a token does."""

    HONOURED = "honoured"  # the token was honoured before: nothing
    STAYS = "stays"  # this pserver stands unchanged at that very checkpoint: the pushes counted are kept
    LOADED = "loaded"  # the checkpoint was loaded: the engine resets to it


class RollBacks:
    """Checkpoints on demand, resume, and roll-backs honoured once per token (sync recovery)."""

    def __init__(self, checkpointer: Optional[Checkpointer], endpoint: str):
        self.checkpointer = checkpointer
        self.endpoint = endpoint
        # The checkpoint this process started from, rolled back to, or (hot standby) its primary's; -1: none.
        self.restored_from = -1
        self.made = 0  # roll-backs made: a change wakes the waits of the abandoned steps
        self._honoured: set = set()
        # Per trainer, the roll-backs counted at its last Hello: a wait from before the latest one
        # belongs to an abandoned timeline (see refuse_wait_from_before_a_roll_back).
        self._hello_rollbacks: Dict[int, int] = {}

    def checkpoint(self, pserver_step: int, roster: Roster) -> Tuple[int, str]:
        """Write a checkpoint at ``pserver_step`` now; (its step, part directory).

        Refused (:class:`NotAllowed`) without a checkpoint_dir; a file system
        error is :class:`StorageFailed`.
        """
        if self.checkpointer is None:
            raise NotAllowed(f"pserver {self.endpoint} has no checkpoint_dir configured")
        try:
            return pserver_step, self.checkpointer.save(pserver_step, roster.to_meta())
        except OSError as e:
            raise StorageFailed(f"pserver {self.endpoint}: checkpoint failed: {e}") from None

    def load(self, step: Optional[int] = None) -> Optional[dict]:
        """Load the latest complete checkpoint (or the one at ``step``) into blocks and tables; its
        manifest or None."""
        return self.checkpointer.load(step)

    def check_can_roll_back(self) -> None:
        """:class:`NotAllowed` without a checkpoint_dir."""
        if self.checkpointer is None:
            raise NotAllowed(f"pserver {self.endpoint} has no checkpoint_dir to roll back from")

    def roll_back(
        self, trainer_id: int, step: int, token: str, pserver_step: int
    ) -> Tuple[RollBack, Optional[dict]]:
        """What a roll-back to the checkpoint at ``step`` asked with ``token`` does at ``pserver_step``; the
        manifest.

        :class:`RollBack.STAYS` when this pserver stands unchanged at that very checkpoint (loaded from it,
        nothing applied since): the pushes counted for the step are valid and kept, since a late roll-back,
        asked for a restart other trainers have already re-synced past, must not discard them.
        :class:`RollBack.LOADED` has loaded the checkpoint into the blocks and tables; the caller resets
        the rest of its state to the manifest. Without a complete checkpoint at ``step``:
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
        return RollBack.LOADED, meta

    def reset_to(self, step: int) -> None:
        """The state was loaded from the checkpoint at ``step``: this pserver's newer parts are abandoned."""
        self.restored_from = step
        if self.checkpointer is not None:
            self.checkpointer.forget_after(step)

    def stands_on(self, step: int) -> None:
        """A backup took its primary's state, which stands on the checkpoint at ``step`` (-1: none)."""
        self.restored_from = step

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
