"""Checkpoints, resume and roll-back of an engine: the recovery side of a pserver's state.

:class:`Checkpoints` is a mixin of :class:`~pserver.engine.base.Engine`: it
works under the engine's lock on its step (``updates``), roster and
``checkpointer``, and calls the engine's hooks ``_clear_pending`` and
``_forget_join_steps`` (what the sync engine keeps of a step in progress), and
``_roster_changed`` once the lock is released.
A roll-back is honoured once per token and wakes the waits of the abandoned
steps with :class:`~pserver.errors.MustResync`.
"""
from __future__ import annotations

import logging
from typing import Optional, Tuple

from ..errors import NotAllowed, StorageFailed

log = logging.getLogger(__name__)


class Checkpoints:
    """Write a checkpoint, resume from one, and roll back to one once per token (sync recovery)."""

    def checkpoint(self) -> Tuple[int, str]:
        """Write a checkpoint of this pserver now, at a step boundary; (its step, part directory).

        Refused (:class:`NotAllowed`) without a checkpoint_dir; a file system
        error is :class:`StorageFailed`.
        """
        if self.checkpointer is None:
            raise NotAllowed(f"pserver {self.endpoint} has no checkpoint_dir configured")
        with self.cv:
            try:
                return self.updates, self.checkpointer.save(self.updates, self.roster.to_meta())
            except OSError as e:
                raise StorageFailed(f"pserver {self.endpoint}: checkpoint failed: {e}") from None

    def _checkpoint_and_export_if_due(self) -> None:
        if not self.writes_files:  # a hot standby: its primary writes them
            return
        if self.checkpointer is not None and self.checkpointer.due(self.updates):
            try:
                self.checkpointer.save(self.updates, self.roster.to_meta())
            except Exception:  # a full disk must not fail the push that was just applied
                log.exception("%s: checkpoint at step %d failed; training goes on and the previous "
                              "checkpoint stays the latest", self.endpoint, self.updates)
        if self.exporter is not None:
            self.exporter.after_update(self.updates)

    def resume(self, step: Optional[int] = None) -> bool:
        """Load the latest complete checkpoint (or the one at ``step``); False if there is none."""
        with self.cv:
            meta = self.checkpointer.load(step)
            if meta is None:
                return False
            self._reset(meta)
            return True

    def restore(self, trainer_id: int, step: int, token: str) -> bool:
        """Roll back to the checkpoint at ``step`` once per ``token`` (sync recovery).

        Returns False when ``token`` was already honoured, or when this pserver
        stands unchanged at that very checkpoint (loaded from it, nothing applied
        since): then the pushes it counted for the step are valid and kept, since
        a late roll-back, asked for a restart other trainers have already re-synced
        past, must not discard them. Otherwise waiters of the abandoned steps are
        woken with :class:`MustResync`. Without a
        checkpoint_dir or a complete checkpoint at ``step``: :class:`NotAllowed`;
        a checkpoint that cannot be read or does not fit: :class:`StorageFailed`,
        and nothing changes.
        """
        if self.checkpointer is None:
            raise NotAllowed(f"pserver {self.endpoint} has no checkpoint_dir to roll back from")
        rolled_back = self._roll_back(trainer_id, step, token)
        if rolled_back:
            self._roster_changed()  # the checkpoint's closed trainers, nobody dropped: after the lock
        return rolled_back

    def _roll_back(self, trainer_id: int, step: int, token: str) -> bool:
        """:meth:`restore` under the lock."""
        with self.cv:
            if token in self._honoured:
                return False
            if self.restored_from == step == self.updates:
                self._honoured.add(token)
                if self._forget_join_steps():
                    # A trainer that was told it starts a step later is now expected in this one: a
                    # wait of its from before is on the abandoned timeline, as after a roll-back.
                    self._rollbacks += 1
                    self.cv.notify_all()
                log.info("%s: already at the checkpoint of step %d, nothing applied since; roll-back asked "
                         "by trainer %d (%s) keeps the pushes counted for it", self.endpoint, step, trainer_id,
                         token)
                return False
            try:
                meta = self.checkpointer.load(step)
            except (OSError, ValueError) as e:  # load's contract: unreadable or unfit, nothing changed
                raise StorageFailed(f"pserver {self.endpoint}: cannot roll back to step {step}: "
                                    f"{e}") from None
            if meta is None:
                raise NotAllowed(f"pserver {self.endpoint}: no complete checkpoint at step {step} "
                                 f"to roll back to (asked by trainer {trainer_id})")
            log.warning("%s: rolled back from step %d to the checkpoint at step %d (asked by trainer %d "
                        "after pservers restarted: %s)", self.endpoint, self.updates, step, trainer_id,
                        token)
            self._honoured.add(token)
            self._reset(meta)
            self._rollbacks += 1
            self.cv.notify_all()
            return True

    def _reset(self, meta: dict) -> None:
        """Take the step and trainers from a loaded checkpoint's manifest (blocks and tables are loaded)."""
        self.updates = self.restored_from = int(meta["step"])
        self.roster.load_meta(meta)
        self._clear_pending()
        if self.checkpointer is not None:
            self.checkpointer.forget_after(self.updates)
        if self.exporter is not None:
            self.exporter.restored()
        if self.replicator is not None:
            self.replicator.reset()
