"""A table shard's row lifecycle: which ids earn a row, which rows go, where cold rows live.

- :mod:`.policy`: :class:`RowLifecycle`, the per-shard policy object (metadata columns, counts).
- :mod:`.admission`: the count-min sketch of pending ids and the probability test.
- :mod:`.eviction`: pure decisions over row metadata (sweeps, row budget, coldest rows).
- :mod:`.tiering`: :class:`~.tiering.DiskTiering`, a shard's disk tier (``ram_rows``): cold rows
  spilled to disk and promoted on access, through the row store's public methods;
  :mod:`.disk_tier`: the LMDB store of their records.

The rules themselves are :mod:`transpiler.lifecycle`'s.
"""

from .policy import META_COLUMNS, LifecycleCounts, RowLifecycle

__all__ = ["META_COLUMNS", "LifecycleCounts", "RowLifecycle"]
