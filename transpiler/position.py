"""Position: where a trainer's data stands, the one definition every package uses.

A trainer pushes its position with each step; pservers keep it with the step
(checkpoints save it), and a trainer that rejoins or rolls back resumes its
data there. Opaque to the pservers. Torch-free, so pure decision code can use it.
"""

from __future__ import annotations

from typing import NamedTuple


class Position(NamedTuple):
    """(epoch, batch) after a step: the next batch a trainer reads is ``batch`` of ``epoch``."""

    epoch: int
    batch: int
