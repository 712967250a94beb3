"""GeoMode: GEO (``k_steps``), where a push is a trainer's change since its last sync, added scaled.

Paddle's GEO-SGD (docs/modes.md#geo): each trainer runs the optimizer on its own copy and every
``k_steps`` steps pushes the change (a delta). A push applies on arrival, as in async mode, but as
that delta divided by the number of trainers, not as a gradient: the blocks (built without optimizer
state for a GEO plan, :class:`pserver.store.BlockStore`) and the table rows (sgd, whose step with the
lr negated adds) take it through their ``add``.
"""

from __future__ import annotations

from typing import Mapping

import torch

from ...tables import SparseGrad
from .asynchronous import AsyncMode
from .mode import EngineParts


class GeoMode(AsyncMode):
    """Applies every push on arrival as deltas times ``scale`` (1 / trainers); no staleness bound (the
    transpiler refuses ``max_staleness`` with ``k_steps``)."""

    def __init__(self, engine: EngineParts):
        super().__init__(engine)
        # Paddle's scaling. Trainers that synced from the same values move the block to the mean of
        # their models (Local SGD's averaging, each trainer on its own clock); a plain sum would take
        # ``trainers`` optimizer steps' worth per window and diverge at the learning rate of one.
        self.scale = 1.0 / engine.trainers

    def apply(
        self, dense: Mapping[str, torch.Tensor], sparse: Mapping[str, SparseGrad], lr_step: int
    ) -> None:
        """Add the deltas times :attr:`scale` (``lr_step`` unused: the trainers' optimizers ran)."""
        self.engine.store.add(dense, self.scale)
        self.engine.tables.add(sparse, self.scale)
