"""TouchedRows: GEO mode's table rows a trainer looked up since its last sync, trained on the trainer.

Per table, rows live in slots in the order their ids were first looked up:
the rows as trained here and as fetched (the base), in buffers that double
when full, so a row is never moved once kept; a sorted index (ids, their
slots) finds them, merged with each lookup's new ids (integers only). A lookup
takes the rows of ids already here and fetches the others, which join at the
lookup's record (:meth:`add`); each step trains the rows that got a gradient
with sgd (:meth:`train`); a sync pushes ``rows - base`` of every row that moved
and starts over (:meth:`take_deltas`). Bound: two rows per distinct id looked up
(with a gradient) since the last sync, so at most ``k_steps`` batches' unique
ids per table (and the buffers' doubling slack).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np
import torch


class _Table:
    """One table's touched rows: slots in first-lookup order, and the sorted index over them."""

    def __init__(self, like: torch.Tensor):
        self.sorted_ids = np.empty(0, dtype=np.int64)
        self.sorted_slots = np.empty(0, dtype=np.int64)
        self.slot_ids = np.empty(0, dtype=np.int64)
        self.rows = like.new_empty((0, like.shape[1]))
        self.base = like.new_empty((0, like.shape[1]))
        self.used = 0

    def append(self, ids: np.ndarray, rows: torch.Tensor) -> None:
        """Keep ``rows`` of ``ids`` (sorted, none held) in the next slots; their base is the same rows."""
        start, end = self.used, self.used + ids.size
        if end > len(self.rows):  # double: adding k batches copies each row O(1) times on average
            capacity = max(end, 2 * len(self.rows), 64)
            self.rows = torch.cat([self.rows[:start], rows.new_empty((capacity - start, rows.shape[1]))])
            self.base = torch.cat([self.base[:start], rows.new_empty((capacity - start, rows.shape[1]))])
            self.slot_ids = np.concatenate(
                [self.slot_ids[:start], np.empty(capacity - start, dtype=np.int64)]
            )
        self.rows[start:end] = rows
        self.base[start:end] = rows
        self.slot_ids[start:end] = ids
        at = np.searchsorted(self.sorted_ids, ids)
        self.sorted_ids = np.insert(self.sorted_ids, at, ids)
        self.sorted_slots = np.insert(self.sorted_slots, at, np.arange(start, end, dtype=np.int64))
        self.used = end


class TouchedRows:
    """The rows of every table touched since the last sync (see the module doc). Not thread-safe."""

    def __init__(self):
        self._tables: Dict[str, _Table] = {}

    def __len__(self) -> int:
        """Rows held, over all tables."""
        return sum(t.used for t in self._tables.values())

    def find(self, table: str, unique_ids: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(hit, slots): which of ``unique_ids`` (sorted) are here, and their slots (``slots[hit]`` is
        meaningful)."""
        held = self._tables.get(table)
        if held is None or held.used == 0:
            return np.zeros(unique_ids.size, dtype=bool), np.zeros(unique_ids.size, dtype=np.int64)
        at = np.minimum(np.searchsorted(held.sorted_ids, unique_ids), held.used - 1)
        return held.sorted_ids[at] == unique_ids, held.sorted_slots[at]

    def rows(self, table: str, slots: np.ndarray) -> torch.Tensor:
        """The rows as trained here in ``slots`` (from :meth:`find`), in a new tensor."""
        return self._tables[table].rows[torch.from_numpy(slots)]

    def add(
        self, table: str, unique_ids: np.ndarray, fetched: torch.Tensor, padding_idx: Optional[int] = None
    ) -> None:
        """Keep the rows ``fetched`` for ``unique_ids`` (sorted) that are not here yet; they are their base.

        ``padding_idx``'s row never trains (and a lookup zeroes it), so it is not kept.
        """
        hit, _ = self.find(table, unique_ids)
        new = ~hit
        if padding_idx is not None:
            new &= unique_ids != padding_idx
        if not new.any():
            return
        # Only the new rows leave the lookup's device (most of a window's lookups hit rows held already).
        rows = fetched.detach()[torch.from_numpy(new).to(fetched.device)].to("cpu")
        held = self._tables.get(table)
        if held is None:
            held = self._tables[table] = _Table(rows)
        held.append(unique_ids[new], rows)

    def train(self, table: str, ids: np.ndarray, grads: torch.Tensor, lr: float) -> None:
        """One sgd step on the rows of ``ids`` (unique; each looked up since the last sync): ``row += -lr *
        grad``.

        torch's update of an ``nn.Embedding`` weight (``param.add_(grad, alpha=-lr)``), row by row.
        """
        hit, slots = self.find(table, ids)
        if not hit.all():
            raise RuntimeError(
                f"table {table!r}: a gradient for {int((~hit).sum())} rows that were not looked up "
                f"since the last sync"
            )
        rows = self._tables[table].rows
        rows.index_add_(0, torch.from_numpy(slots), grads.to(rows.dtype), alpha=-lr)

    def take_deltas(self) -> Dict[str, Tuple[np.ndarray, torch.Tensor]]:
        """``{table: (ids, rows - base)}`` of the rows that moved since the last sync; forgets every row."""
        out = {}
        for table, held in self._tables.items():
            delta = held.rows[: held.used] - held.base[: held.used]
            moved = (delta != 0).any(dim=1).numpy()
            out[table] = (held.slot_ids[: held.used][moved], delta[torch.from_numpy(moved)])
        self.clear()
        return out

    def clear(self) -> None:
        """Forget every row (a sync pushed them, or the trainer re-synced with the pservers)."""
        self._tables = {}
