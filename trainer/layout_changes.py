"""FollowsLayout: how a pserver-mode trainer follows its job to another pserver count (docs/operations.md,
"Growing and shrinking a job"), the part of :class:`~trainer.pserver_trainer.PserverTrainer` that adopts
a layout.

A call answered "moved" (kind MOVED: the job changed its pserver count, the answer names the layout it runs
now) is not an error to the script: the trainer adopts that layout (its blocks, connections, stepper and
table client rebuilt, the model and data position kept) and makes the call again there. A step's push
goes again with the step's gradients (the table gradients, not yet routed, carried by
:class:`~trainer.errors.StepMoved`); a lookup's rows are fetched there, the lookups already made this step
carried over to the new table client; a pull is made again.
"""

from __future__ import annotations

import logging
from typing import Dict, Optional

from transpiler import TrainerProgram
from transpiler.layout.change import check_later_layout, moved_to, next_trainer_program

from .blocks import LocalBlocks
from .embedding import serve_tables_from
from .errors import MOVED, PserverError, StepMoved
from .steppers.local import LocalStepper
from .transport import Channels

log = logging.getLogger(__name__)


class FollowsLayout:
    """The methods of a pserver-mode trainer that follow its job's layout (mixed into PserverTrainer)."""

    def adopt(self, program: TrainerProgram) -> None:
        """Go on in the layout of ``program``: this trainer's plan after a change of its job's pserver count
        (:func:`transpiler.layout.change.next_trainer_program`).

        The step in flight is flushed, the connections to the current pservers are released without a
        Close (the trainer does not leave the job), and the blocks, connections and stepper are rebuilt for
        the next pservers, which are joined at the step they stand at; the model, the data position and a
        loop over :meth:`batches` go on. ValueError for a plan that is not a later layout of this job, or
        for a trainer that cannot change layout yet (GEO, trainer nodes, the async pipeline, backup
        trainers).
        """
        self._check_open()
        now = self.program
        check_later_layout(now, program)
        if type(self.stepper) is not LocalStepper or now.config.backup_trainers:
            raise ValueError(
                f"trainer {self.trainer_id}: a change of layout is not supported with "
                f"{type(self.stepper).__name__}{' and backup trainers' if now.config.backup_trainers else ''}"
                f" yet (only one process per trainer, sync or async without the pipeline)"
            )
        self.stepper.flush()
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        self.stepper.close(None)  # the old layout's connections: no Close, this trainer stays in the job
        looked_up = self.tables  # this step's lookups so far are pushed in the next layout
        self.program = program
        self.blocks = LocalBlocks(program, self.model)
        self.channels = Channels(program, self._security)
        self.recovery = self._recovery(program)
        self.stepper = self._stepper(self._init_method)
        self.tables = self.stepper.tables
        self.feed.follow(
            self._pull,
            self.stepper.plan_next_batch if program.tables else None,
            self.stepper.end_epoch,
        )
        # Heartbeats first: the next layout's pservers count this trainer from their start, and the join
        # waits for the slowest of them (a new one still starting) while the others would drop it.
        self._heartbeat = self._start_heartbeat()
        self.stepper.join()
        self.tables.carry_lookups(looked_up)
        self.tables.follow_moves(self._adopt_moved)
        serve_tables_from(self.model, program.tables, self.tables)
        log.info(
            "trainer %d: adopted layout epoch %d at step %d: %d blocks on %d pservers",
            self.trainer_id,
            program.layout_epoch,
            self.step_count,
            len(self.blocks.by_name),
            len(program.pservers),
        )

    def _adopt_moved(self, error: PserverError) -> None:
        """Adopt the layout a "moved" answer (``error``) names: the job changed its pserver count."""
        named = moved_to(str(error))
        if named is None:
            raise error
        log.info("trainer %d: %s", self.trainer_id, error)
        epoch, pservers, replicas = named
        self.adopt(next_trainer_program(self.program, pservers, replicas, epoch=epoch))

    def _pull(self) -> None:
        """:meth:`Stepper.pull`, in the layout the job runs now (a "moved" answer adopted)."""
        while True:  # each adopt is of a later layout: this ends
            try:
                return self.stepper.pull()
            except PserverError as e:
                if e.kind != MOVED:
                    raise
                self._adopt_moved(e)

    def _step_in_layout(self, prefetch: Optional[Dict[str, object]]) -> None:
        """:meth:`Stepper.step`, pushed again in the layout the job runs now if it was answered "moved"."""
        moved = None
        while True:  # each adopt is of a later layout: this ends
            try:
                if moved is None:
                    self.stepper.step(prefetch, self.feed.take_next_plan)
                elif applied_before_the_switch(moved.step, self.stepper.state.step):
                    self.stepper.clear_grads()  # joined past it, its parameters pulled
                    self.tables.clear()
                else:  # the job changed its pserver count: the step again, in its layout now; the next
                    # batch's plan routed its ids to the pservers before (its lookups fetch for themselves)
                    self.stepper.step(prefetch, lambda: None, moved.table_grads)
                return
            except StepMoved as e:
                moved = e
                self._adopt_moved(e.error)


def applied_before_the_switch(pushed_step: int, joined_step: int) -> bool:
    """Whether a step whose push was answered "moved" (``pushed_step``) was applied in the layout that ended,
    the trainer having joined the next one at ``joined_step``: a push is answered "moved" unapplied when it
    came after the switch, but also when the pserver applied it, wrote its part of the switch and died
    before answering (hot standby: its backup then answers "moved"); the next layout starts past it."""
    return joined_step > pushed_step
