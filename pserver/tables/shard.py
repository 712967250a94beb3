"""TableShard: one pserver's shard of a distributed embedding table, compact and vectorised.

A shard holds the rows of the ids ``i`` with ``shard_of(i, n_shards) == shard``
(see :mod:`transpiler.tables`), created on their first update, plus their
sparse-optimizer state. Nothing is stored per id in Python objects; every
operation works on whole batches with numpy.

Layout (``n`` rows stored, ``C`` row capacity, ``S`` index slots)::

    slots  int32 (S,)         open-addressing index: row number or -1 (empty);
                              S a power of two, n / S <= 0.7 (doubled beyond)
    ids    int64 (C,)         ids[r] = the id of row r (the index's keys)
    rows   dtype (C, dim)     row values; rows [0, n) are live
    state  dtype (C, dim) x k optimizer state (k = 0 sgd, 1 adagrad, 2 adam)
    meta   (C,) x c           row metadata (:mod:`pserver.tables.lifecycle`): seen_step
                              always, score and seen_time when a rule needs them

Index: linear probing (:mod:`pserver.tables.id_index`). Inserting a batch
places the new row numbers at the empty slot each id's probe stopped at.
Eviction (:mod:`pserver.tables.lifecycle`) deletes keys from the index by
backward shift and keeps rows dense: the live rows past the new end move into
the holes, and the slots after ``n`` are reused by later inserts.

Growth: the row arrays live on private anonymous memory maps (huge pages
requested) and grow by 1.25x with ``mmap.resize``, i.e. ``mremap``: no copy and
no second copy of the table in memory (see :class:`Growable`). The index
doubles and is rebuilt from ``ids`` when the load factor would pass 0.7. The
initial capacity is ``num_embeddings / n_shards`` capped at 1M rows, so a huge
hint does not allocate gigabytes up front. Rows are gathered and scattered as
opaque ``dim * itemsize``-byte records (:func:`gather`, :func:`scatter`).

Memory per stored row, with raw = ``8 + dim * itemsize * (1 + k) + meta``
(meta 8 bytes, 16 with a score rule, 24 with a wall-clock rule as well)::

    bytes/row = (C / n) * raw + 4 * S / n  <=  1.25 * raw + 4 / 0.35

(right after both a row growth and an index doubling; 4 * S / n is 5.7-11.4
bytes). For dim 16 float32 that is at most 1.39x raw for sgd (raw 80 B) and
1.30x for adam (raw 208 B).

Thread safety: :meth:`TableShard.lookup`, :meth:`~TableShard.apply` and
:meth:`~TableShard.save` take one lock, so a lookup never sees an array that
is being grown or rebuilt. ``initial_rows`` of ids a lookup misses is computed
after releasing it (a pure function of seed and id) and kept a while
(:mod:`pserver.tables.fresh`): the apply that inserts those ids, usually the
next push, copies them instead of computing them again under the lock, as it
does for ids no recent lookup asked for. The whole file write of a save runs
under the lock too.

Files: see :mod:`pserver.tables.files` (``save`` / ``load`` / :func:`export_table`).
"""
from __future__ import annotations

import logging
import threading
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch

from psproto.dtypes import TABLE_DTYPES
from transpiler.tables import TableSpec, as_ids, initial_rows, shard_of

from ..errors import BadRequest
from . import files as table_files
from .fresh import FreshRows
from .id_index import EMPTY, MAX_LOAD, build_index, delete, home_slots, load_kernels, place, probe, slots_for
from .lifecycle import META_COLUMNS, RowLifecycle
from .rows import Growable, gather, scatter
from .sparse_optim import make_rule

log = logging.getLogger(__name__)

GROWTH = 1.25             # row capacity growth factor: small, to stay near raw bytes
MAX_INITIAL_ROWS = 1 << 20  # cap on the num_embeddings-derived initial capacity
MIN_ROWS = 16
_CHUNK = 1 << 22          # ids read at once when loading: bounds temporaries
_INIT_VALUES = 1 << 16    # values of initial rows computed at once (see initial_rows_into)


def initial_rows_into(spec: TableSpec, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out[:] = initial_rows(spec, ids)``, computed in chunks of about 64k values.

    ``initial_rows`` makes several float64/uint64 temporaries of the size of
    its output; chunks keep them in cache and small: 1M rows of dim 16 take
    ~0.4 s instead of ~2 s, and no ~0.6 GB transient.
    """
    step = max(256, _INIT_VALUES // max(1, spec.dim))
    for a in range(0, ids.size, step):
        out[a:a + step] = initial_rows(spec, ids[a:a + step])
    return out


def _as_ids(ids) -> np.ndarray:
    """``ids`` read by :func:`transpiler.tables.as_ids`; :class:`BadRequest` if they are not 1-D integers."""
    if getattr(ids, "ndim", 1) != 1:
        raise BadRequest(f"ids must be 1-D, got shape {list(ids.shape)}")
    try:
        return as_ids(ids)
    except TypeError as e:
        raise BadRequest(str(e)) from None



class TableShard:
    """One pserver's shard of a distributed table: id index, rows, optimizer state.

    Rows are created when an id is first updated by :meth:`apply`, with its
    initial value ``initial_rows(spec, id)``; :meth:`lookup` of an id never
    updated returns that value without storing it. ``step`` counts
    :meth:`apply` calls (the optimizer's per-table step). Thread-safe.
    """

    def __init__(self, spec: TableSpec, shard: int, n_shards: int):
        if n_shards < 1 or not 0 <= shard < n_shards:
            raise ValueError(f"table {spec.name!r}: shard {shard} is not in [0, {n_shards})")
        if spec.dtype not in TABLE_DTYPES:
            raise ValueError(f"table {spec.name!r}: dtype {spec.dtype!r} is not one of "
                             f"{sorted(TABLE_DTYPES)}")
        self.spec = spec
        self.shard = shard
        self.n_shards = n_shards
        self.step = 0
        self.dtype = np.dtype(spec.dtype)
        self._rule = make_rule(spec.optimizer.name, spec.optimizer.kwargs)
        self.life = RowLifecycle(spec, n_shards)
        self.exported_step = -1  # table step of the last export; -1: none since this shard was built
        self._lock = threading.Lock()
        self._n = 0
        hint = -(-int(spec.capacity) // n_shards) if spec.capacity else 0
        cap = min(max(hint, MIN_ROWS), MAX_INITIAL_ROWS)
        # ids, rows, then the optimizer's state arrays; the attributes below are their views.
        self._store = [Growable(cap, (), np.int64), Growable(cap, (spec.dim,), self.dtype)]
        self._store += [Growable(cap, (spec.dim,), self.dtype) for _ in self._rule.state_names]
        self._store += [Growable(cap, (), META_COLUMNS[c]) for c in self.life.columns]
        self._refresh_views()
        self._slots = np.full(slots_for(cap), EMPTY, dtype=np.int32)
        self._index_nbytes = self._slots.nbytes
        self._fresh = FreshRows()
        load_kernels()

    # -- public --------------------------------------------------------------

    def __len__(self) -> int:
        """Rows stored (ids updated at least once)."""
        return self._n

    @property
    def rows_held(self) -> int:
        """Rows held, in memory and in the disk tier (lock-free)."""
        return self._n + self.disk_rows

    @property
    def disk_rows(self) -> int:
        """Rows in the disk tier (0 without one)."""
        return 0

    @property
    def disk_bytes(self) -> int:
        """Bytes the disk tier uses (0 without one)."""
        return 0

    @property
    def capacity(self) -> int:
        """Rows allocated (stored + spare) in every row array."""
        return min(g.capacity for g in self._store)

    @property
    def nbytes(self) -> int:
        """Bytes of every array this shard holds, at allocated capacity (index, ids, rows, state).

        Lock-free (safe to poll from another thread, even during a growth).
        """
        return self._index_nbytes + sum(g.capacity * g.row_bytes for g in self._store)

    @property
    def raw_bytes_per_row(self) -> int:
        """Bytes one row needs at least: its int64 id, its values and its state."""
        meta = sum(META_COLUMNS[c].itemsize for c in self.life.columns)
        return 8 + self.spec.dim * self.dtype.itemsize * (1 + len(self._state)) + meta

    def stored_ids(self) -> np.ndarray:
        """A copy of the ids holding a row, in row order."""
        with self._lock:
            return self._ids[:self._n].copy()

    def check_ids(self, ids: np.ndarray) -> None:
        """Raise :class:`BadRequest` naming the table, this shard and an example id if any id is not ours.

        An id belongs to shard ``stable_hash_ids(id) % n_shards``; a misrouted id
        would be stored on the wrong pserver and never found by the others.
        """
        ids = _as_ids(ids)
        if self.n_shards == 1 or ids.size == 0:
            return
        owner = shard_of(ids, self.n_shards)
        bad = owner != self.shard
        if bad.any():
            i = int(np.argmax(bad))
            raise BadRequest(
                f"table {self.spec.name!r}: {int(bad.sum())} of {ids.size} ids do not belong to "
                f"shard {self.shard} of {self.n_shards}, e.g. id {int(ids[i])} (shard {int(owner[i])})")

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Rows of ``ids`` (int64 1-D, any order, repeats allowed) as a new (len(ids), dim) array.

        Stored rows are gathered under the lock; ids never updated get their
        initial value, computed after releasing it, and are not inserted.
        """
        ids = _as_ids(ids)
        with self._lock:
            rows, _ = probe(self._slots, self._ids, ids, home_slots(ids, self._slots.size),
                            want_stop=False)
            # An empty slot's -1 gathers the last allocated row; overwritten below.
            out = gather(self._rows, rows)
        missing = rows < 0
        if missing.any():
            new_ids = ids[missing]
            fresh = initial_rows_into(self.spec, new_ids, np.empty((new_ids.size, self.spec.dim), self.dtype))
            out[missing] = fresh
            self._fresh.remember(new_ids, fresh)
        return out

    def apply(self, ids: np.ndarray, grads, lr: float) -> None:
        """One sparse optimizer step on the rows ``ids`` (UNIQUE, int64 1-D, possibly empty).

        ``grads``: (len(ids), dim) of the table's dtype, numpy or torch. Ids not
        stored yet are inserted with their initial value first. ``step``
        advances by one even when ``ids`` is empty, as torch counts a step for
        every parameter that had a gradient.
        """
        ids = _as_ids(ids)
        g = grads.detach().cpu().numpy() if isinstance(grads, torch.Tensor) else np.asarray(grads)
        if g.shape != (ids.size, self.spec.dim) or g.dtype != self.dtype:
            raise ValueError(f"table {self.spec.name!r}: gradient is {g.dtype} {list(g.shape)}, "
                             f"expected {self.dtype} {[ids.size, self.spec.dim]}")
        with self._lock:
            step = self.step + 1
            if ids.size:
                rows, stop = probe(self._slots, self._ids, ids, home_slots(ids, self._slots.size))
                missing = rows < 0
                if missing.any():
                    miss = np.flatnonzero(missing)
                    admitted = self.life.admit(ids[miss])
                    if not admitted.all():  # pending ids: their gradients are dropped
                        keep = np.ones(ids.size, dtype=bool)
                        keep[miss[~admitted]] = False
                        ids, g, rows, stop = ids[keep], g[keep], rows[keep], stop[keep]
                        missing = rows < 0
                    rows[missing] = self._insert(ids[missing], stop[missing])
                param = gather(self._rows, rows)
                states = [gather(s, rows) for s in self._state]
                self._rule.update(param, states, g, float(lr), step)
                scatter(self._rows, rows, param)
                for s, v in zip(self._state, states):
                    scatter(s, rows, v)
                self.life.touch(self._meta, rows, step)
            self.step = step
            self._end_step(step)

    def export_changes(self, full: bool) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, rows, tombstones) for an export: every row (``full``) or those updated since the last.

        Tombstones are the ids evicted since the last export that hold no row
        now (an id evicted and admitted again is among the rows); a full
        export drops them. Copies under the lock; marks this step exported.
        """
        with self._lock:
            n = self._n
            gone = self.life.take_tombstones()
            if full:
                sel, gone = np.arange(n), np.empty(0, np.int64)
            else:
                sel = np.flatnonzero(self._meta["seen_step"][:n] > self.exported_step)
                if gone.size:
                    back = probe(self._slots, self._ids, gone, home_slots(gone, self._slots.size),
                                 want_stop=False)[0]
                    gone = gone[back < 0]
            out = self._ids[sel].copy(), gather(self._rows, sel)
            self.exported_step = self.step
        return out[0], out[1], gone

    def save(self, directory: str) -> None:
        """Write this shard's stored rows, state and step to ``directory`` (see :mod:`pserver.tables.files`).

        Holds the lock for the whole write, so the files are one consistent
        snapshot; updates wait meanwhile.
        """
        with self._lock:
            n = self._n
            arrays = {"ids": self._ids[:n], "rows": self._rows[:n]}
            for name, s in zip(self._rule.state_names, self._state):
                arrays[name] = s[:n]
            arrays.update(self._live())
            extra = self.life.admission.sketch.state() if self.life.admission and self.life.admission.sketch else {}
            table_files.write_shard(directory, arrays, table_files.shard_meta(
                self.spec, self.shard, self.n_shards, self.step, n, list(arrays), list(extra)), extra)

    @classmethod
    def load(cls, spec: TableSpec, shard: int, n_shards: int, directories: Sequence[str]) -> "TableShard":
        """Rebuild shard ``shard`` of ``n_shards`` from the shard directories of a saved run.

        The saved run may have had another number of shards: only ids with
        ``shard_of(id, n_shards) == shard`` are kept, with their state. With the
        same number of shards, ``directories`` needs only this shard's own
        directory; otherwise every saved shard (all may hold our ids).
        Directories of another table, dim, dtype or optimizer, incomplete
        saves and repeated shards are refused with ValueError. Shards saved at
        different steps (an async job) load; a re-shard takes the highest step.
        """
        sources, step = table_files.open_shards(spec, directories, shard, n_shards)
        table = cls(spec, shard, n_shards)
        names = ["rows", *table._rule.state_names]
        defaults = table.life.defaults(step)
        for src in sources:
            columns = [c for c in table.life.columns if c in src.arrays]
            for ids, arrays in table_files.iter_selected(src, names + columns, shard, n_shards, _CHUNK):
                table._append(ids, arrays, src.directory)
                saved = dict(zip(columns, arrays[len(names):]))
                for c, column in table._meta.items():
                    column[table._n - ids.size:table._n] = saved[c] if c in saved else defaults[c]
            sketch = table.life.admission.sketch if table.life.admission else None
            if sketch is not None and "sketch" in src.extra:
                sketch.merge_saved(src.extra["sketch"])
        table.step = step
        log.info("table %s: loaded shard %d/%d, %d rows, step %d, from %d directories",
                 spec.name, shard, n_shards, table._n, step, len(sources))
        return table

    # -- internals (caller holds the lock, or owns the object) ---------------

    def _live(self) -> Dict[str, np.ndarray]:
        return {name: column[:self._n] for name, column in self._meta.items()}

    def _end_step(self, step: int) -> None:
        """The lifecycle's end of ``step``: evictions due, then the admission counts' decay."""
        if self.life.evicts:
            self._remove(self.life.victims(self._ids[:self._n], self._live(), step))
        self.life.end_step(step)

    def _remove(self, victims: np.ndarray) -> None:
        """Delete the rows ``victims`` (sorted, distinct row numbers): index entries, then compaction.

        Rows stay dense in ``[0, n)``: the live rows after the new end move
        into the holes below it (every array: ids, rows, state, metadata), and
        their index entries are re-pointed; the space after ``n`` is reused
        by the next inserts. Without numba the index is rebuilt instead.
        """
        k = victims.size
        if k == 0:
            return
        n, m = self._n, self._n - victims.size
        gone = self._ids[victims]
        in_place = delete(self._slots, self._ids, gone)
        holes = victims[victims < m]
        movers = np.setdiff1d(np.arange(m, n), victims, assume_unique=True)
        moved_ids = self._ids[movers]
        for g in self._store:
            a = g.array
            if a.ndim == 2:
                scatter(a, holes, gather(a, movers))
            else:
                a[holes] = a[movers]
        self._n = m
        if in_place:
            pos = probe(self._slots, self._ids, moved_ids, home_slots(moved_ids, self._slots.size))[1]
            self._slots[pos] = holes.astype(np.int32)
        else:
            self._slots = build_index(self._ids, m, self._slots.size)
        self.life.evicted(gone)
        log.debug("table %s shard %d: evicted %d rows, %d left", self.spec.name, self.shard, k, m)

    def _reserve(self, n_rows: int) -> None:
        """Room for ``n_rows`` rows in the row arrays and the index."""
        if n_rows >= 2 ** 31:  # row numbers are int32 in the index
            raise MemoryError(f"table {self.spec.name!r}: shard {self.shard} would hold {n_rows} "
                              f"rows, more than 2**31 - 1; use more pservers")
        cap = self.capacity
        if n_rows > cap:
            new = max(n_rows, int(cap * GROWTH) + 1)
            self._grow_rows(new)
            log.debug("table %s shard %d: capacity %d -> %d rows", self.spec.name, self.shard, cap, new)
        if n_rows > MAX_LOAD * self._slots.size:
            n_slots, old = slots_for(n_rows), self._slots.size
            self._slots = None  # free the old index before building the new one
            try:
                self._slots = build_index(self._ids, self._n, n_slots)
            except MemoryError:
                self._slots = build_index(self._ids, self._n, old)
                raise
            self._index_nbytes = self._slots.nbytes
            log.debug("table %s shard %d: index rebuilt with %d slots", self.spec.name, self.shard, n_slots)

    def _refresh_views(self) -> None:
        self._ids, self._rows, *rest = (g.array for g in self._store)
        k = len(self._rule.state_names)
        self._state = rest[:k]
        self._meta = dict(zip(self.life.columns, rest[k:]))

    def _grow_rows(self, capacity: int) -> None:
        """Grow every row array to ``capacity``; our views are dropped first so maps can move."""
        self._ids = self._rows = None
        self._state, self._meta = [], {}
        try:
            for g in self._store:
                g.grow(capacity, self._n)
        finally:
            self._refresh_views()

    def _insert(self, new_ids: np.ndarray, stop: np.ndarray) -> np.ndarray:
        """Store absent, distinct ``new_ids`` with initial rows and state; return their row numbers.

        ``stop`` is where their probes stopped; it is recomputed if the index
        had to be rebuilt to make room. Repeated new ids would each get a row
        and corrupt the index, so they are refused first (a sort of the new
        ids only; cheap next to computing their initial rows).
        """
        if new_ids.size > 1:
            s = np.sort(new_ids)
            if (s[1:] == s[:-1]).any():
                dup = int(s[1:][s[1:] == s[:-1]][0])
                raise ValueError(f"table {self.spec.name!r}: id {dup} appears twice in one update; "
                                 f"ids must be unique (see merge_duplicates)")
        start, m = self._n, new_ids.size
        n_slots = self._slots.size
        self._reserve(start + m)
        if self._slots.size != n_slots:
            stop = probe(self._slots, self._ids, new_ids, home_slots(new_ids, self._slots.size))[1]
        end = start + m
        self._ids[start:end] = new_ids
        dest = self._rows[start:end]
        left = self._fresh.take(new_ids, dest)
        if left.size:
            dest[left] = initial_rows_into(self.spec, new_ids[left], np.empty((left.size, self.spec.dim), self.dtype))
        for s, v in zip(self._state, self._rule.state_init):
            s[start:end] = v
        for column in self._meta.values():  # score 0: the update that follows makes it 1
            column[start:end] = 0
        rownums = np.arange(start, end, dtype=np.int32)
        place(self._slots, stop, rownums)
        self._n = end
        return rownums

    def _append(self, ids: np.ndarray, arrays: List[np.ndarray], origin: str) -> None:
        """Store saved rows (ids, [rows, *state]) as they are, refusing ids already present."""
        m = ids.size
        if m == 0:
            return
        start = self._n
        self._reserve(start + m)
        found, stop = probe(self._slots, self._ids, ids, home_slots(ids, self._slots.size))
        end = start + m
        rownums = np.arange(start, end, dtype=np.int32)
        if (found >= 0).any():
            dup = int(ids[np.argmax(found >= 0)])
            raise ValueError(f"table {self.spec.name!r}: id {dup} in {origin} was already loaded "
                             f"from another directory; a shard directory was given twice or is corrupt")
        self._ids[start:end] = ids
        self._rows[start:end] = arrays[0]
        for s, v in zip(self._state, arrays[1:]):
            s[start:end] = v
        place(self._slots, stop, rownums)
        self._n = end
        # A file repeating an id would leave two slots for one key; the second is unreachable.
        again = probe(self._slots, self._ids, ids, home_slots(ids, self._slots.size), want_stop=False)[0]
        if not np.array_equal(again, rownums):
            dup = int(ids[np.argmax(again != rownums)])
            raise ValueError(f"table {self.spec.name!r}: id {dup} appears twice in {origin}")
