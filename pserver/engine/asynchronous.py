"""AsyncEngine: each gradient is applied on arrival; ``max_staleness`` bounds how far ahead a trainer runs."""

from __future__ import annotations

import logging
from typing import Dict, List, Mapping, Optional, Tuple, Union

import torch

from ..tables import SparseGrad
from .engine import Engine
from .roster import Position
from .waits import Parked

log = logging.getLogger(__name__)


class AsyncEngine(Engine):
    """Applies every push on arrival, optionally bounding staleness."""

    def __init__(self, *args, max_staleness=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_staleness = max_staleness

    def _slowest(self, trainer_id: int) -> Tuple[int, List[int]]:
        others = self.live() - {trainer_id}
        if not others:
            return None, []
        progress = {t: self.last_step.get(t, -1) + 1 for t in others}
        low = min(progress.values())
        return low, sorted(t for t, p in progress.items() if p == low)

    def push(
        self,
        trainer_id: int,
        step: int,
        grads: Dict[str, torch.Tensor],
        sparse: Optional[Mapping[str, SparseGrad]] = None,
        position: Position = (0, 0),
        park: bool = False,
    ) -> Union[Tuple[bool, int], Parked]:
        """Apply ``grads`` and ``sparse`` now (after any staleness wait); returns (counted, the pserver's
        step).

        With ``park``, a push past ``max_staleness`` changes nothing and returns the handle of its wait
        instead: push again once it is done. Nothing is kept once this returns: the caller keeps its
        buffers.
        """
        with self.cv:
            self.roster.check_pusher(trainer_id, self.endpoint, self.step)
            if self.max_staleness is not None:

                def fresh_enough():
                    low, _ = self._slowest(trainer_id)
                    return low is None or step - low <= self.max_staleness

                if not fresh_enough():
                    what = f"trainer {trainer_id}'s step {step} (max_staleness={self.max_staleness})"
                    missing = lambda: self._slowest(trainer_id)[1]  # noqa: E731
                    if park:
                        return self.waits.park(fresh_enough, what, missing, trainer=trainer_id)
                    self.waits.wait(fresh_enough, what, missing)
            # Checked after the wait: a retry may have been applied meanwhile.
            if step <= self.last_step.get(trainer_id, -1):
                return False, self.step
            self.store.apply(grads, step)
            self.tables.apply(sparse or {}, step)
            self.step += 1
            self.last_step[trainer_id] = step
            self.roster.positions[trainer_id] = position
            self._applied(step, grads, sparse or {})
            self.waits.notify()
            return True, self.step
