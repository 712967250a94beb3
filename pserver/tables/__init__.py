"""Distributed tables on a pserver: its shard of every table, by id.

- :mod:`.table_set`: :class:`TableSet`, every table shard of one pserver, fed whole requests.
- :mod:`.shard`: :class:`TableShard`, one table's rows on one pserver (lookup, sparse update), composed of
  its rows in memory, its disk tier (with ``ram_rows``) and its row lifecycle.
- :mod:`.row_store`: :class:`~.row_store.RowStore`, the rows in memory: arrays, id index, growth, removal.
- :mod:`.id_index`: the vectorised open-addressing index from id to row; :mod:`.compiled.index_kernels` its
  numba-compiled probe and insert; :mod:`.compiled.row_kernels` a plain table's whole apply and lookup
  compiled; :mod:`.compiled.init_kernels` initial rows compiled (bit for bit the definition's).
- :mod:`.rows`: growable row storage, record-wise gather and scatter; :mod:`.fresh`: initial rows a lookup
  computed, kept for the insert that follows.
- :mod:`.step_sums`: a sync step's sparse gradients merged on arrival in float64 (memory bounded by its
  ids, not trainers; the mean independent of the order of arrival).
- :mod:`.sparse_optim`: torch-exact sparse SGD, Adagrad and Adam (SparseAdam) rules.
- :mod:`.files`: shard files (atomic save, re-sharding load); :mod:`.plain_files`: a save merged into one
  file set per table, readable with numpy alone, which :mod:`.cli` writes.
- :mod:`.lifecycle`: admission, eviction and their row metadata (docs/tables.md, "Table lifecycle").
- :mod:`.serving`: base + delta exports for serving, and the numpy-only reader.

The names are imported on first use: a light module of the package (the serving reader, the id index) loads
neither torch nor the shard's modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from transpiler.lazy import lazy_exports

__getattr__ = lazy_exports(
    __name__, {"TableSet": ".table_set", "TableShard": ".shard", "SparseGrad": ".table_set"}
)
__all__ = ["TableSet", "TableShard", "SparseGrad"]

if TYPE_CHECKING:
    from .shard import TableShard
    from .table_set import SparseGrad, TableSet
