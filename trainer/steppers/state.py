"""StepState: where a trainer stands (its step and data position), shared by the parts that move it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from transpiler.position import Position

from ..recovery import ROLLBACK, Decision


@dataclass
class StepState:
    """A trainer's step, data position, and the two flags that change what its next step does.

    The stepper moves ``step`` and ``position`` (a step taken, a re-sync);
    the feed sets ``batch_position`` while a batch trains and reads
    ``rewound``; a lookup that re-synced sets ``discard``. Every part holds
    the same object, so none calls back into the trainer to learn or move
    where it stands.
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
            self.rewound = True  # batches() replays the data from the checkpoint's position
