"""TableShard: one pserver's shard of a distributed embedding table, compact and vectorised.

A shard holds the rows of the ids ``i`` with ``shard_of(i, n_shards) == shard``
(see :mod:`transpiler.tables`), created on their first update, plus their
sparse-optimizer state. Nothing is stored per id in Python objects; every
operation works on whole batches with numpy.

A shard is composed of parts it holds: its rows in memory, a :class:`RowStore`
(:mod:`pserver.tables.row_store`: arrays, index, growth, removal, memory per
row); with ``ram_rows``, its disk tier, a :class:`DiskTiering`
(:mod:`pserver.tables.lifecycle.tiering`), which moves rows in and out of the
row store through its public methods; its :class:`RowLifecycle` (admission,
eviction, row metadata: :mod:`pserver.tables.lifecycle`). A *plain* table (no
admission, eviction or disk tier) runs each apply and lookup as one compiled
call without the GIL (:mod:`pserver.tables.compiled.row_kernels`).

Thread safety: lookups, applies and saves take one lock, so a lookup never sees
an array being grown or rebuilt. ``initial_rows`` of ids a lookup misses is
computed after releasing it; version 1's ``normal`` rows are kept a while
(:mod:`pserver.tables.fresh`) for the apply that inserts those ids, usually the
next push (a plain table's other rows are computed again in the apply's
kernel: cheaper than keeping them, :mod:`pserver.tables.compiled.row_kernels`).

Files: see :mod:`pserver.tables.files` (``save`` / ``load``) and :mod:`pserver.tables.plain_files` (export).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Iterator, Optional, Sequence, Tuple

import numpy as np
import torch

from psproto.dtypes import TABLE_DTYPES
from transpiler.tables import TableSpec

from . import files as table_files
from . import id_index
from .fresh import FreshRows, initial_rows_into
from .lifecycle import RowLifecycle
from .lifecycle.tiering import DiskTiering
from .row_store import RowStore
from .shard_ids import as_shard_ids, check_shard_ids, merged_gradient
from .sparse_optim import make_rule

log = logging.getLogger(__name__)

_CHUNK = 1 << 22  # ids read at once when loading: bounds temporaries


class TableShard:
    """One pserver's shard of a distributed table: id index, rows, optimizer state.

    Rows are created when an id is first updated by :meth:`apply`, with its
    initial value ``initial_rows(spec, id)``; :meth:`lookup` of an id never
    updated returns that value without storing it. ``step`` counts
    :meth:`apply` calls (the optimizer's per-table step). Thread-safe.
    ``disk_dir``: where the disk tier goes when the table has ``ram_rows``
    (:mod:`pserver.tables.lifecycle.tiering`). ``memory`` holds the rows in
    memory, ``disk`` the disk tier (None without ``ram_rows``).
    """

    def __init__(self, spec: TableSpec, shard: int, n_shards: int, disk_dir: Optional[str] = None):
        if n_shards < 1 or not 0 <= shard < n_shards:
            raise ValueError(f"table {spec.name!r}: shard {shard} is not in [0, {n_shards})")
        if spec.dtype not in TABLE_DTYPES:
            raise ValueError(
                f"table {spec.name!r}: dtype {spec.dtype!r} is not one of {sorted(TABLE_DTYPES)}"
            )
        self.spec = spec
        self.shard = shard
        self.n_shards = n_shards
        self.dtype = np.dtype(spec.dtype)
        self.step = 0
        self._rule = make_rule(spec.optimizer.name, spec.optimizer.kwargs)
        self.life = RowLifecycle(spec, n_shards)
        self.exported_step = -1  # table step of the last export; -1: none since this shard was built
        self._lock = threading.Lock()
        self._fresh = FreshRows()
        self.memory = RowStore(
            spec, shard, n_shards, self._rule.state_init, self.life.columns, self._initial_into
        )
        self.disk = (
            DiskTiering(spec, shard, n_shards, self.memory, self.life, disk_dir)
            if spec.lifecycle.ram_rows
            else None
        )
        self.compiled = None  # a plain table's row_kernels.CompiledRows
        if self.life.plain and self.disk is None and id_index.load_kernels() is not None:
            from .compiled.row_kernels import compiled_rows

            self.compiled = compiled_rows(spec, self._rule)

    # -- public --------------------------------------------------------------

    def __len__(self) -> int:
        """Rows held in memory (all rows, without a disk tier)."""
        return len(self.memory)

    @property
    def capacity(self) -> int:
        """Rows allocated in memory (stored + spare)."""
        return self.memory.capacity

    @property
    def nbytes(self) -> int:
        """Bytes of every array held in memory, at allocated capacity (lock-free)."""
        return self.memory.nbytes

    @property
    def raw_bytes_per_row(self) -> int:
        """Bytes one row needs at least: its int64 id, its values, its state and its metadata."""
        return self.memory.raw_bytes_per_row

    @property
    def rows_held(self) -> int:
        """Rows held, in memory and in the disk tier (lock-free)."""
        return len(self.memory) + self.disk_rows

    @property
    def disk_rows(self) -> int:
        """Rows in the disk tier (0 without one)."""
        return 0 if self.disk is None else len(self.disk)

    @property
    def disk_bytes(self) -> int:
        """Bytes the disk tier uses (0 without one)."""
        return 0 if self.disk is None else self.disk.nbytes

    def relabel(self, shard: int, n_shards: int, step: int) -> None:
        """Become shard ``shard`` of ``n_shards`` at table step ``step`` or later: a change of layout moved
        the rows that make it so (:mod:`pserver.layout.slot_moves`)."""
        if n_shards < 1 or not 0 <= shard < n_shards:
            raise ValueError(f"table {self.spec.name!r}: shard {shard} is not in [0, {n_shards})")
        with self._lock:
            self.shard, self.n_shards, self.step = shard, n_shards, max(self.step, step)
            self.memory.relabel(shard)
            self.life.reshare(n_shards)
            if self.disk is not None:
                self.disk.reshare(shard, n_shards)

    def close_disk(self) -> None:
        """Close and remove the disk tier's working store, if any (the shard's rows on disk are gone)."""
        if self.disk is not None:
            self.disk.close()

    @contextlib.contextmanager
    def reading(self) -> Iterator[RowStore]:
        """The shard's lock held: its rows in memory, to read (a digest) while nothing else changes them,
        or to move rows in or out (:mod:`pserver.layout.slot_moves`)."""
        with self._lock:
            yield self.memory

    def stored_ids(self) -> np.ndarray:
        """A copy of the ids holding a row: in memory (in row order), then on disk."""
        with self._lock:
            if self.disk is None:
                return self.memory.ids.copy()
            return np.concatenate([self.memory.ids, *self.disk.field_chunks(-1)])

    def check_ids(self, ids: np.ndarray) -> None:
        """:class:`BadRequest` naming the table, this shard and an example if any of ``ids`` is not ours."""
        check_shard_ids(self.spec.name, ids, self.shard, self.n_shards)

    def merged_gradient(self, ids: np.ndarray, rows):
        """A push's gradient of this table, ``(ids, rows)``, checked as :meth:`check_ids` does and with its
        repeated ids summed: what :meth:`apply` takes."""
        return merged_gradient(self.spec.name, ids, rows, self.shard, self.n_shards)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Rows of ``ids`` (int64 1-D, any order, repeats allowed) as a new (len(ids), dim) array.

        Stored rows are gathered under the lock (rows in the disk tier are
        brought back to memory first); ids never updated get their initial
        value, computed after releasing it, and are not inserted.
        """
        ids = as_shard_ids(ids)
        if self.compiled is not None:
            return self.lookup_into(ids, np.empty((ids.size, self.spec.dim), self.dtype))
        with self._lock:
            rows = self.memory.find(ids, want_stop=False)[0]
            missing = rows < 0
            # Rows on disk come back to memory now: the push that follows a lookup updates them,
            # and finds them in memory.
            if self.disk is not None and missing.any() and self.disk.promote_absent(ids[missing]):
                rows = self.memory.find(ids, want_stop=False)[0]
                missing = rows < 0
            # An empty slot's -1 gathers the last allocated row; overwritten below.
            out = self.memory.gather(rows)
        if missing.any():
            self._fill_initial(ids, np.flatnonzero(missing), out)
        return out

    def lookup_into(self, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """:meth:`lookup` written into ``out`` ((len(ids), dim) of the table's dtype, e.g. a view of an answer
        payload); returns ``out``.

        A plain table finds and copies the rows under the lock in one compiled call.
        """
        ids = as_shard_ids(ids)
        if out.shape != (ids.size, self.spec.dim) or out.dtype != self.dtype:
            raise ValueError(f"rows {[ids.size, self.spec.dim]} do not fit {out.dtype} {out.shape}")
        if self.compiled is None:
            out[...] = self.lookup(ids)
            return out
        into = out if out.flags.c_contiguous and out.flags.writeable else np.empty_like(out)
        with self._lock:
            miss = self.memory.lookup_compiled(self.compiled, ids, into)
        if miss.size:
            self._fill_initial(ids, miss, into)
        if into is not out:
            out[...] = into
        return out

    def apply(self, ids: np.ndarray, grads, lr: float) -> None:
        """One sparse optimizer step on the rows ``ids`` (UNIQUE, int64 1-D, possibly empty).

        ``grads``: (len(ids), dim) of the table's dtype, numpy or torch. Ids not
        stored yet are inserted with their initial value first. ``step``
        advances by one even when ``ids`` is empty, as torch counts a step for
        every parameter that had a gradient.
        """
        ids = as_shard_ids(ids)
        g = grads.detach().cpu().numpy() if isinstance(grads, torch.Tensor) else np.asarray(grads)
        if g.shape != (ids.size, self.spec.dim) or g.dtype != self.dtype:
            raise ValueError(
                f"table {self.spec.name!r}: gradient is {g.dtype} {list(g.shape)}, "
                f"expected {self.dtype} {[ids.size, self.spec.dim]}"
            )
        memory = self.memory
        if self.compiled is not None:  # a view of a received payload is used as it is
            g = np.ascontiguousarray(g)
            with self._lock:
                added = memory.apply_compiled(self.compiled, ids, g, lr, self.step + 1, self._initial_into)
                self.life.admitted(added)
                self.step += 1
            return
        with self._lock:
            step = self.step + 1
            if ids.size:
                rows, stop = memory.find(ids)
                # Rows on disk come back first: they hold rows already.
                if self.disk is not None and self.disk.promote(ids, rows):
                    rows, stop = memory.find(ids)
                missing = rows < 0
                if missing.any():
                    miss = np.flatnonzero(missing)
                    admitted = self.life.admit(ids[miss])
                    if not admitted.all():  # pending ids: their gradients are dropped
                        keep = np.ones(ids.size, dtype=bool)
                        keep[miss[~admitted]] = False
                        ids, g, rows, stop = ids[keep], g[keep], rows[keep], stop[keep]
                        missing = rows < 0
                    rows[missing] = memory.insert(ids[missing], stop[missing])
                param, states = memory.gather(rows), memory.gather_state(rows)
                self._rule.update(param, states, g, float(lr), step)
                memory.scatter(rows, param, states)
                self.life.touch(memory.meta, rows, step)
            self.step = step
            self._end_step(step)

    def export_changes(self, full: bool) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, rows, tombstones) for an export: every row (``full``) or those updated since the last.

        Tombstones are the ids evicted since the last export that hold no row
        now (an id evicted and admitted again is among the rows); a full
        export drops them. Copies under the lock; marks this step exported.
        """
        memory = self.memory
        with self._lock:
            gone = self.life.take_tombstones()
            if full:
                sel, gone = np.arange(len(memory)), np.empty(0, np.int64)
            else:
                sel = np.flatnonzero(memory.meta["seen_step"] > self.exported_step)
                if gone.size:
                    gone = gone[memory.find(gone, want_stop=False)[0] < 0]
                    if self.disk is not None and gone.size:
                        gone = gone[~self.disk.holds(gone)]
            ids, rows = [memory.ids[sel].copy()], [memory.gather(sel)]
            if self.disk is not None:
                for part_ids, part_rows in self.disk.changed(None if full else self.exported_step):
                    ids.append(part_ids)
                    rows.append(part_rows)
            self.exported_step = self.step
        return np.concatenate(ids), np.concatenate(rows), gone

    def save(self, directory: str) -> None:
        """Write this shard's stored rows, state and step to ``directory`` (see :mod:`pserver.tables.files`).

        Holds the lock for the whole write, so the files are one consistent
        snapshot; updates wait meanwhile.
        """
        memory, disk = self.memory, self.disk
        with self._lock:
            n = len(memory)
            arrays = {"ids": memory.ids, "rows": memory.rows}
            arrays.update(zip(self._rule.state_names, memory.state))
            arrays.update(memory.meta)
            if disk is not None and len(disk):  # every row: memory, then disk, chunk by chunk
                arrays, n = disk.saved_arrays(arrays, n), n + len(disk)
            extra = (
                self.life.admission.sketch.state()
                if self.life.admission and self.life.admission.sketch
                else {}
            )
            table_files.write_shard(
                directory,
                arrays,
                table_files.shard_meta(
                    self.spec, self.shard, self.n_shards, self.step, n, list(arrays), list(extra)
                ),
                extra,
            )

    @classmethod
    def load(
        cls,
        spec: TableSpec,
        shard: int,
        n_shards: int,
        directories: Sequence[str],
        disk_dir: Optional[str] = None,
    ) -> "TableShard":
        """Rebuild shard ``shard`` of ``n_shards`` from the shard directories of a saved run.

        The saved run may have had another number of shards: only ids with
        ``shard_of(id, n_shards) == shard`` are kept, with their state. With the
        same number of shards, ``directories`` needs only this shard's own
        directory; otherwise every saved shard (all may hold our ids).
        Directories of another table, dim, dtype or optimizer, incomplete
        saves and repeated shards are refused with ValueError. Shards saved at
        different steps (an async job) load; a re-shard takes the highest step.
        With a disk tier, rows beyond the RAM budget go to disk chunk by chunk.
        """
        sources, step = table_files.open_shards(spec, directories, shard, n_shards)
        table = cls(spec, shard, n_shards, disk_dir)
        names = ["rows", *table._rule.state_names]
        defaults = table.life.defaults(step)
        for src in sources:
            columns = [c for c in table.life.columns if c in src.arrays]
            for ids, arrays in table_files.iter_selected(src, names + columns, shard, n_shards, _CHUNK):
                saved = dict(zip(columns, arrays[len(names) :]))
                table.memory.append(
                    ids,
                    arrays[: len(names)],
                    {c: saved[c] if c in saved else defaults[c] for c in table.life.columns},
                    src.directory,
                )
                if table.disk is not None:
                    table.disk.spill()
            sketch = table.life.admission.sketch if table.life.admission else None
            if sketch is not None and "sketch" in src.extra:
                sketch.merge_saved(src.extra["sketch"])
        table.step = step
        log.info(
            "table %s: loaded shard %d/%d, %d rows, step %d",
            spec.name,
            shard,
            n_shards,
            len(table.memory),
            step,
        )
        return table

    # -- internals (caller holds the lock, or owns the object) ---------------

    def _initial_into(self, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Initial rows of new ids into ``out``: those a recent lookup kept are copied, the rest computed."""
        left = self._fresh.take(ids, out)
        if left.size:
            out[left] = initial_rows_into(
                self.spec, ids[left], np.empty((left.size, self.spec.dim), self.dtype)
            )
        return out

    def _fill_initial(self, ids: np.ndarray, miss: np.ndarray, out: np.ndarray) -> None:
        """``out[miss]`` = the initial rows of ``ids[miss]``, after a lookup released the lock."""
        if self.compiled is not None and not self.compiled.given:
            self.compiled.fill(ids, miss, out)
            return
        out[miss] = fresh = initial_rows_into(
            self.spec, ids[miss], np.empty((miss.size, self.spec.dim), self.dtype)
        )
        self._fresh.remember(ids[miss], fresh)

    def _end_step(self, step: int) -> None:
        """The lifecycle's end of ``step``: evictions due, then the admission counts' decay, then the
        spill."""
        memory, disk = self.memory, self.disk
        if self.life.evicts:
            self.life.evicted(memory.remove(self.life.victims(memory.ids, memory.meta, step)))
            if disk is not None:
                self.life.evicted(disk.sweep(step))
        self.life.end_step(step)
        if disk is not None:
            disk.spill()
