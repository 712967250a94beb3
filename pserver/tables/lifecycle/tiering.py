"""The disk tier of a table shard: a RAM budget, cold rows on local disk, promoted on access.

With ``ram_rows`` (:mod:`transpiler.lifecycle`), a shard keeps at most its
share of that many rows in memory at the end of every step: the least
recently updated rows beyond it (then the smallest ids) move, with their
optimizer state and metadata packed into one fixed-size record each, to a
:class:`~pserver.tables.lifecycle.disk_tier.DiskTier` (LMDB) in the pserver's
``table_disk_dir``. An update of a row on disk first brings its record back
into memory (promotion), so the update is exactly the all-in-RAM table's; so
does a lookup (its push follows). Eviction sweeps cover the rows on
disk too. Records move bit for bit, so training equals the all-in-RAM table.

The store is a working area: checkpoints and saves write every row (memory
and disk) into the usual shard files, and a (re)started pserver opens an
empty store and loads those files, spilling as it goes. A SIGKILL in the
middle of a spill therefore loses nothing the last checkpoint had. A spill
that fails (the disk or the store's size limit is full) changes nothing: the
rows stay in memory, the failure is logged with what to do, and the next
step tries again.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import tempfile
from typing import Callable, Dict, Iterator, Optional, Tuple

import numpy as np

from transpiler.tables import TableSpec

from ..files import Chunked
from ..row_store import RowStore
from .disk_tier import DiskTier, DiskTierFull
from .eviction import coldest, sweep_due, sweep_victims
from .policy import META_COLUMNS, RowLifecycle

log = logging.getLogger(__name__)

_DISK_CHUNK = 1 << 16  # records read at once when sweeping or saving the disk tier


def record_dtype(dim: int, dtype: np.dtype, n_state: int, columns) -> np.dtype:
    """One packed record: the row, each optimizer state array, each metadata column."""
    fields = [("rows", dtype, (dim,))] + [(f"state{i}", dtype, (dim,)) for i in range(n_state)]
    fields += [(c, META_COLUMNS[c]) for c in columns]
    return np.dtype(fields)


class DiskTiering:
    """The disk tier of one table shard (``ram_rows`` set): what moves between its rows in memory and disk.

    ``memory`` is the shard's :class:`~pserver.tables.row_store.RowStore`,
    reached through its public methods; ``life`` its
    :class:`~pserver.tables.lifecycle.RowLifecycle` (counts, sweep clock).
    Every method runs under the shard's lock. ``root``: the pserver's
    ``table_disk_dir`` (None: the system's temporary directory, with a warning).
    """

    def __init__(
        self,
        spec: TableSpec,
        shard: int,
        n_shards: int,
        memory: RowStore,
        life: RowLifecycle,
        root: Optional[str],
    ):
        self.spec, self.shard = spec, shard
        self.memory = memory
        self.life = life
        lc = spec.lifecycle
        if root is None:
            root = os.path.join(tempfile.gettempdir(), "ps-table-disk-tier")
            log.warning("table %s: no table_disk_dir set; its disk tier goes to %s", spec.name, root)
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", spec.name)
        directory = os.path.join(root, f"{name}.shard-{shard}-of-{n_shards}.pid-{os.getpid()}")
        self.ram_share = lc.shard_share(lc.ram_rows, n_shards)
        self._record = record_dtype(spec.dim, memory.dtype, memory.n_state, memory.columns)
        self._seen_step = 1 + memory.n_state  # the record field of the seen_step column
        self._store = DiskTier(directory, self._record.itemsize)
        self.nbytes = 0  # as of the last spill: read lock-free by the metrics
        self.spill_failures = 0
        log.info(
            "table %s shard %d: %d rows in memory, the rest in %s",
            spec.name,
            shard,
            self.ram_share,
            directory,
        )

    def __len__(self) -> int:
        """Rows on disk."""
        return len(self._store)

    def close(self) -> None:
        """Close and remove the working store (the shard's rows on disk are gone)."""
        self._store.close()
        with contextlib.suppress(OSError):  # the shard's own directory, empty now
            os.rmdir(self._store.directory)

    # -- records -------------------------------------------------------------

    def _pack(self, rownums: np.ndarray) -> np.ndarray:
        rec = np.empty(rownums.size, self._record)
        for name, a in zip(self._record.names, self.memory.arrays()):
            rec[name] = a[rownums]
        return rec.view(np.uint8).reshape(rownums.size, self._record.itemsize)

    def _unpack(self, records: np.ndarray) -> list:
        rec = np.ascontiguousarray(records).view(self._record).reshape(-1)
        return [rec[name] for name in self._record.names]

    # -- promotion and reads ---------------------------------------------------

    def promote(self, ids: np.ndarray, rows: np.ndarray) -> int:
        """Bring the rows of ``ids`` (distinct) that are on disk into memory; how many were.

        ``rows`` (the ids' rows in memory, -1 where absent) is updated in place.
        """
        if not len(self._store):
            return 0
        miss = np.flatnonzero(rows < 0)
        if miss.size == 0:
            return 0
        found, records = self._store.pop(ids[miss])
        if not found.any():
            return 0
        at = miss[found]
        stop = self.memory.find(ids[at])[1]
        rows[at] = self.memory.insert(ids[at], stop, self._unpack(records[found]))
        self.life.promoted(at.size)
        return at.size

    def promote_absent(self, ids: np.ndarray) -> int:
        """Bring the rows of ``ids`` (none in memory; repeats allowed) that are on disk into memory; how
        many."""
        miss = np.unique(ids)
        return self.promote(miss, np.full(miss.size, -1, dtype=np.int32))

    def holds(self, ids: np.ndarray) -> np.ndarray:
        """Whether each of ``ids`` has its row on disk (bool per id)."""
        return self._store.get(ids)[0]

    # -- end of step -----------------------------------------------------------

    def spill(self) -> None:
        """Move the coldest rows beyond the RAM share to disk; on a full disk, keep them and log."""
        memory = self.memory
        if len(memory) <= self.ram_share:
            return
        victims = np.sort(coldest(len(memory) - self.ram_share, memory.ids, memory.meta["seen_step"]))
        try:
            self._store.put(memory.ids[victims], self._pack(victims))
        except DiskTierFull as e:
            self.spill_failures += 1
            if self.spill_failures == 1 or self.spill_failures % 100 == 0:
                log.error(
                    "table %s shard %d: spill of %d rows failed (%d failures so far); the rows stay "
                    "in memory: %s",
                    self.spec.name,
                    self.shard,
                    victims.size,
                    self.spill_failures,
                    e,
                )
            return
        memory.remove(victims)
        self.life.spilled(victims.size)
        self.nbytes = self._store.nbytes

    def sweep(self, step: int) -> np.ndarray:
        """The ids on disk an eviction sweep at ``step`` removes (deleted from the store)."""
        if not len(self._store) or not sweep_due(self.spec.lifecycle, step):
            return np.empty(0, np.int64)
        gone = []
        now = self.life.clock()
        for ids, records in self._store.iter_chunks(_DISK_CHUNK):
            meta = dict(zip(self._record.names, self._unpack(records)))
            go = sweep_victims(
                self.spec.lifecycle, step, now, meta["seen_step"], meta.get("score"), meta.get("seen_time")
            )
            gone.append(ids[go])
        gone = np.concatenate(gone) if gone else np.empty(0, np.int64)
        self._store.delete(gone)
        return gone

    # -- a change of layout ----------------------------------------------------------

    def select(self, keep: Callable[[np.ndarray], np.ndarray]) -> Iterator[Tuple[np.ndarray, list]]:
        """(ids, [rows, *state, *metadata]) of the rows on disk whose ids ``keep`` (a bool mask of ids)
        selects, chunk by chunk."""
        for ids, records in self._store.iter_chunks(_DISK_CHUNK):
            sel = keep(ids)
            if sel.any():
                yield ids[sel], [f[sel] for f in self._unpack(records)]

    def delete_where(self, keep: Callable[[np.ndarray], np.ndarray]) -> int:
        """Delete the rows on disk whose ids ``keep`` selects; how many."""
        gone = [ids[keep(ids)] for ids, _ in self._store.iter_chunks(_DISK_CHUNK)]
        gone = np.concatenate(gone) if gone else np.empty(0, np.int64)
        if gone.size:
            self._store.delete(gone)
            self.nbytes = self._store.nbytes
        return int(gone.size)

    def reshare(self, shard: int, n_shards: int) -> None:
        """The RAM share of shard ``shard`` of ``n_shards`` (the job's pserver count changed)."""
        self.shard = shard
        self.ram_share = self.spec.lifecycle.shard_share(self.spec.lifecycle.ram_rows, n_shards)

    # -- exports and saves ---------------------------------------------------------

    def changed(self, since: Optional[int]) -> Iterator[Tuple[np.ndarray, np.ndarray]]:
        """(ids, rows) on disk, chunk by chunk: all (``since`` None) or those updated after table step
        ``since``."""
        for ids, records in self._store.iter_chunks():
            values = self._unpack(records)
            keep = slice(None) if since is None else values[self._seen_step] > since
            yield ids[keep], values[0][keep]

    def saved_arrays(self, arrays: Dict[str, np.ndarray], n: int) -> Dict[str, Chunked]:
        """A save's ``arrays`` (the ``n`` rows in memory, by file name) with the rows on disk after them,
        each written chunk by chunk (:class:`~pserver.tables.files.Chunked`)."""
        return {
            name: Chunked(
                n + len(self),
                a.shape[1:],
                a.dtype,
                lambda a=a, i=i - 1: itertools.chain([a], self.field_chunks(i)),
            )
            for i, (name, a) in enumerate(arrays.items())
        }

    def field_chunks(self, index: int) -> Iterator[np.ndarray]:
        """Field ``index`` of every record on disk (-1: the ids; then rows, state, metadata), chunk by
        chunk."""
        for ids, records in self._store.iter_chunks(_DISK_CHUNK):
            yield ids if index < 0 else self._unpack(records)[index]
