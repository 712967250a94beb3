"""Moving a table's slots between live shards: the rows of some slots copied out of one shard with all
they carry (values, optimizer state, lifecycle metadata, disk-tier rows), put into another, and dropped
where they were. A change of pserver count (:mod:`transpiler.layout.moves`) streams these.

The result equals saving the shards and loading them re-sharded (``TableShard.load``) for every row, its
state and metadata (tested); the admission sketch cannot be cut by slot, so a receiving shard adds the
sender's counts to its own, as a re-shard sums the saved shards' (an over-estimate: ids are admitted no
later than they would have been). Putting the rows of a slot replaces whatever the receiver held in it,
so a move sent twice lands once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np

from transpiler.layout.routing import N_SLOTS, slot_of

from ..tables.shard import TableShard


@dataclass
class SlotRows:
    """The rows a table shard held in some slots: ids, values, optimizer state arrays (in the rule's
    order), lifecycle metadata columns, the sender's admission sketch (None without one) and table step
    (the receiver relabels itself at the latest of its senders': ``TableShard.relabel``)."""

    table: str
    step: int
    ids: np.ndarray
    rows: np.ndarray
    state: List[np.ndarray]
    meta: Dict[str, np.ndarray]
    sketch: Optional[np.ndarray] = None

    @property
    def nbytes(self) -> int:
        """Bytes of every array the rows carry."""
        arrays = [self.ids, self.rows, *self.state, *self.meta.values()]
        return sum(a.nbytes for a in arrays)


def slot_mask(slots: np.ndarray) -> np.ndarray:
    """A bool mask over every slot, True at ``slots`` (slot numbers)."""
    mask = np.zeros(N_SLOTS, dtype=bool)
    mask[np.asarray(slots, dtype=np.int64)] = True
    return mask


def _in(mask: np.ndarray, ids: np.ndarray) -> np.ndarray:
    return mask[slot_of(ids)]


def take_slots(shard: TableShard, mask: np.ndarray) -> SlotRows:
    """A copy of the rows ``shard`` holds in the slots of ``mask``, in memory and on disk; the shard is
    unchanged. One consistent cut: taken under the shard's lock."""
    with shard.reading() as memory:
        sel = np.flatnonzero(_in(mask, memory.ids))
        ids, fields = [memory.ids[sel]], [[a[sel] for a in memory.arrays()]]
        if shard.disk is not None:
            for part_ids, part_fields in shard.disk.select(lambda i: _in(mask, i)):
                ids.append(part_ids)
                fields.append(part_fields)
        columns = [np.concatenate(f) for f in zip(*fields)]
        n_state = len(memory.state)
        sketch = shard.life.admission.sketch if shard.life.admission else None
        return SlotRows(
            shard.spec.name,
            shard.step,
            np.concatenate(ids),
            columns[0],
            columns[1 : 1 + n_state],
            dict(zip(memory.meta, columns[1 + n_state :])),
            None if sketch is None else sketch.state()["sketch"].copy(),
        )


def drop_slots(shard: TableShard, mask: np.ndarray) -> int:
    """Remove the rows ``shard`` holds in the slots of ``mask`` (they moved away); how many. Not
    evictions: no tombstones, no counts."""
    with shard.reading() as memory:
        victims = np.flatnonzero(_in(mask, memory.ids))
        gone = memory.remove(victims).size
        if shard.disk is not None:
            gone += shard.disk.delete_where(lambda i: _in(mask, i))
        return gone


def put_slots(shard: TableShard, mask: np.ndarray, moved: SlotRows) -> None:
    """Make ``moved`` the rows ``shard`` holds in the slots of ``mask`` (whatever it held there goes);
    ``ValueError`` if ``moved`` is of another table or holds an id outside those slots."""
    if moved.table != shard.spec.name:
        raise ValueError(f"rows of table {moved.table!r} cannot go into table {shard.spec.name!r}")
    if moved.ids.size and not _in(mask, moved.ids).all():
        bad = int(moved.ids[np.argmin(_in(mask, moved.ids))])
        raise ValueError(f"table {moved.table!r}: id {bad} is not in the slots being put")
    drop_slots(shard, mask)
    with shard.reading() as memory:
        memory.append(moved.ids, [moved.rows, *moved.state], moved.meta, "a moved slot")
        sketch = shard.life.admission.sketch if shard.life.admission else None
        if sketch is not None and moved.sketch is not None:
            sketch.merge_saved(moved.sketch)
        if shard.disk is not None:
            shard.disk.spill()
