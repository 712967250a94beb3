"""StepState: where a trainer stands (its step and data position), shared by the parts that move it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from transpiler.position import Position

from ..recovery import ROLLBACK, Decision


@dataclass
class StepState:
    """A trainer's step, data position, and the two flags that change what its next step does.

    Every part holds the same object and moves it through the methods below,
    which say what happened: the stepper's steps and re-syncs, the feed's
    batches and epochs, a lookup that re-synced. So none calls back into the
    trainer to learn or move where it stands.
    """

    step: int = 0
    position: Position = Position(0, 0)
    # The data position after the batch being trained, while Trainer.batches() runs.
    batch_position: Optional[Position] = None
    # A lookup of this batch re-synced the trainer to another step: the batch's step pushes nothing.
    discard: bool = False
    # The job moved this trainer (a roll-back, a re-sync on a node): batches() starts the epoch over.
    rewound: bool = False

    def next_position(self) -> Position:
        """The data position once the current batch is trained (outside ``batches()``: one more batch)."""
        return self.batch_position or Position(0, self.step + 1)

    def advance(self, step: int, position: Position) -> None:
        """A step went through: the trainer stands at ``step``, its data at ``position``."""
        self.step, self.position = step, position

    def moved(self, decision: Decision) -> None:
        """Recovery moved the trainer to ``decision.step``; a roll-back also moves its data back."""
        self.step = decision.step
        if decision.action == ROLLBACK:
            self.position = decision.position
            self.rewind()  # batches() replays the data from the checkpoint's position

    def rewind(self) -> None:
        """The batch being trained is not the next one: ``batches()`` starts over from :attr:`position`."""
        self.rewound = True

    def begin_epoch(self) -> None:
        """``batches()`` starts a pass over the data at :attr:`position`: any rewind is done with."""
        self.rewound = False

    def end_epoch(self, epoch: int) -> None:
        """The loader ran out in ``epoch``: the data goes on at the first batch of the next one."""
        self.position = Position(epoch + 1, 0)

    def begin_batch(self, position: Position) -> None:
        """A batch starts training; ``position``: the data position once it is trained."""
        self.batch_position = position

    def end_batches(self) -> None:
        """``batches()`` stopped handing out batches (the epoch ended, a rewind, or the loop was left)."""
        self.batch_position = None

    def discard_batch(self) -> None:
        """A lookup of this batch re-synced the trainer: the batch's step pushes nothing."""
        self.discard = True

    def take_discarded(self) -> bool:
        """Whether this batch's step was discarded (:meth:`discard_batch`); the next one is not."""
        discarded, self.discard = self.discard, False
        return discarded
