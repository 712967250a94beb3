"""AsyncMode: each gradient is applied on arrival; ``max_staleness`` bounds how far ahead a trainer runs."""

from __future__ import annotations

from typing import AbstractSet, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from ...tables import SparseGrad
from ..roster import Position
from ..waits import Parked
from .mode import EngineParts, Mode


def slowest(others: AbstractSet[int], last_step: Mapping[int, int]) -> Tuple[Optional[int], List[int]]:
    """(the lowest next step among ``others``, those at it, sorted); (None, []) without others.

    A trainer's next step is one past its last applied (``last_step``; 0 for one that never pushed).
    """
    if not others:
        return None, []
    progress = {t: last_step.get(t, -1) + 1 for t in others}
    low = min(progress.values())
    return low, sorted(t for t, p in progress.items() if p == low)


def fresh_enough(step: int, slowest_step: Optional[int], max_staleness: int) -> bool:
    """Whether a push of ``step`` may apply: at most ``max_staleness`` steps past the slowest other
    trainer's next step (None: no other trainer, nobody to wait for)."""
    return slowest_step is None or step - slowest_step <= max_staleness


class AsyncMode(Mode):
    """Applies every push on arrival, optionally bounding staleness (``max_staleness``, None: unbounded)."""

    def __init__(self, engine: EngineParts, max_staleness: Optional[int] = None):
        super().__init__(engine)
        self.max_staleness = max_staleness

    def _slowest(self, trainer_id: int) -> Tuple[Optional[int], List[int]]:
        return slowest(self.engine.live() - {trainer_id}, self.engine.roster.last_step)

    def push(
        self,
        trainer_id: int,
        step: int,
        grads: Mapping[str, torch.Tensor],
        sparse: Optional[Mapping[str, SparseGrad]],
        position: Position,
        park: bool,
        step_trainers: Sequence[int],
        dropped: bool,
    ) -> Union[Tuple[bool, int], Parked]:
        """Apply ``grads`` and ``sparse`` now (after any staleness wait); returns (counted, the pserver's
        step).

        With ``park``, a push past ``max_staleness`` changes nothing and returns the handle of its wait
        instead: push again once it is done. Nothing is kept once this returns: the caller keeps its
        buffers.
        """
        engine = self.engine
        if self.max_staleness is not None:

            def ready():
                return fresh_enough(step, self._slowest(trainer_id)[0], self.max_staleness)

            if not ready():
                what = f"trainer {trainer_id}'s step {step} (max_staleness={self.max_staleness})"
                missing = lambda: self._slowest(trainer_id)[1]  # noqa: E731
                if park:
                    return engine.waits.park(ready, what, missing, trainer=trainer_id)
                engine.waits.wait(ready, what, missing)
        # Checked after the wait: a retry may have been applied meanwhile.
        last = engine.roster.last_step
        if step <= last.get(trainer_id, -1):
            return False, engine.step
        sparse = sparse or {}
        self.apply(grads, sparse, step)
        last[trainer_id] = step
        engine.roster.positions[trainer_id] = position
        engine.advance(step, grads, sparse)
        return True, engine.step
