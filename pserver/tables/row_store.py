"""RowStore: the arrays of a table shard and their id index; inserts, appends, removals, growth.

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
Removing rows (eviction, the disk tier) deletes their keys from the index by
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

Not thread-safe: :class:`pserver.tables.shard.TableShard` holds one (its rows
in memory) and calls every method under its lock; its disk tier
(:mod:`pserver.tables.lifecycle.tiering`) moves rows in and out through the
same public methods.
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from transpiler.tables import TableSpec

from .id_index import EMPTY, MAX_LOAD, build_index, delete, home_slots, load_kernels, place, probe, slots_for
from .lifecycle import META_COLUMNS
from .rows import Growable, gather, scatter

log = logging.getLogger(__name__)

GROWTH = 1.25  # row capacity growth factor: small, to stay near raw bytes
MAX_INITIAL_ROWS = 1 << 20  # cap on the num_embeddings-derived initial capacity
MIN_ROWS = 16


class RowStore:
    """Rows, optimizer state and metadata of one table shard, found by id through the index.

    ``state_init``: the initial value of each optimizer state array;
    ``columns``: the metadata columns rows carry; ``initial_into(ids, out)``
    writes the initial values of new rows into ``out`` (see :meth:`insert`).
    Row numbers (what :meth:`find` and :meth:`insert` give) index the views
    :attr:`ids`, :attr:`rows`, :attr:`state` and :attr:`meta` until the next
    call that changes the rows.
    """

    def __init__(
        self,
        spec: TableSpec,
        shard: int,
        n_shards: int,
        state_init: Sequence[float],
        columns: Sequence[str],
        initial_into: Callable[[np.ndarray, np.ndarray], None],
    ):
        self.spec = spec
        self.shard = shard
        self.dtype = np.dtype(spec.dtype)
        self._initial_into = initial_into
        self._state_init = list(state_init)
        self.n_state = len(self._state_init)
        self.columns = list(columns)
        self._n = 0
        hint = -(-int(spec.capacity) // n_shards) if spec.capacity else 0
        cap = min(max(hint, MIN_ROWS), MAX_INITIAL_ROWS)
        # ids, rows, the optimizer's state arrays, the metadata; the attributes below are their views.
        self._store = [Growable(cap, (), np.int64), Growable(cap, (spec.dim,), self.dtype)]
        self._store += [Growable(cap, (spec.dim,), self.dtype) for _ in range(self.n_state)]
        self._store += [Growable(cap, (), META_COLUMNS[c]) for c in self.columns]
        self._refresh_views()
        self._slots = np.full(slots_for(cap), EMPTY, dtype=np.int32)
        self._index_nbytes = self._slots.nbytes
        load_kernels()

    def __len__(self) -> int:
        """Rows stored."""
        return self._n

    def relabel(self, shard: int) -> None:
        """The shard these rows now make (a change of layout; its logs name it)."""
        self.shard = shard

    # -- views of the rows stored (rows [0, n)) ---------------------------------

    @property
    def ids(self) -> np.ndarray:
        """The id of each stored row (a view)."""
        return self._ids[: self._n]

    @property
    def rows(self) -> np.ndarray:
        """The stored rows' values, (n, dim) (a view)."""
        return self._rows[: self._n]

    @property
    def state(self) -> List[np.ndarray]:
        """The stored rows' optimizer state arrays, (n, dim) each (views)."""
        return [s[: self._n] for s in self._state]

    @property
    def meta(self) -> Dict[str, np.ndarray]:
        """The stored rows' metadata, {column: (n,) view}."""
        return {name: column[: self._n] for name, column in self._meta.items()}

    def arrays(self) -> List[np.ndarray]:
        """Every stored array after ids, in order: rows, the state arrays, the metadata columns (views)."""
        return [self.rows, *self.state, *self.meta.values()]

    @property
    def index_slots(self) -> int:
        """Slots of the id index (a power of two; rows stored / slots <= 0.7)."""
        return self._slots.size

    @property
    def capacity(self) -> int:
        """Rows allocated (stored + spare) in every row array."""
        return min(g.capacity for g in self._store)

    @property
    def nbytes(self) -> int:
        """Bytes of every array held, at allocated capacity (index, ids, rows, state, metadata).

        Lock-free (safe to poll from another thread, even during a growth).
        """
        return self._index_nbytes + sum(g.capacity * g.row_bytes for g in self._store)

    @property
    def raw_bytes_per_row(self) -> int:
        """Bytes one row needs at least: its int64 id, its values, its state and its metadata."""
        meta = sum(META_COLUMNS[c].itemsize for c in self.columns)
        return 8 + self.spec.dim * self.dtype.itemsize * (1 + self.n_state) + meta

    # -- finding, reading and writing rows ------------------------------------------

    def find(self, ids: np.ndarray, want_stop: bool = True) -> Tuple[np.ndarray, np.ndarray]:
        """(row of each id or -1, slot where its probe stopped): one probe per id."""
        return probe(self._slots, self._ids, ids, home_slots(ids, self._slots.size), want_stop=want_stop)

    def gather(self, rownums: np.ndarray) -> np.ndarray:
        """A new (len(rownums), dim) array of the rows ``rownums``' values.

        A -1 (an id :meth:`find` did not find) gathers the last allocated row:
        the caller overwrites it.
        """
        return gather(self._rows, rownums)

    def gather_state(self, rownums: np.ndarray) -> List[np.ndarray]:
        """New arrays of the optimizer state of the rows ``rownums``, one per state array."""
        return [gather(s, rownums) for s in self._state]

    def scatter(self, rownums: np.ndarray, values: np.ndarray, state: Sequence[np.ndarray]) -> None:
        """Write the values and optimizer state of the distinct stored rows ``rownums``."""
        scatter(self._rows, rownums, values)
        for s, v in zip(self._state, state):
            scatter(s, rownums, v)

    def apply_compiled(
        self, compiled, ids: np.ndarray, grads: np.ndarray, lr: float, step: int, given_rows
    ) -> int:
        """One optimizer step on the rows of distinct ``ids`` in one compiled call
        (:func:`pserver.tables.compiled.row_kernels.apply`; ``compiled``: the table's
        :class:`~pserver.tables.compiled.row_kernels.CompiledRows`); returns the rows inserted.

        Where the kernel needs room, the arrays grow and it runs again; ``given_rows(new_ids, out)``
        writes the initial rows it cannot compute (version 1's normal). A repeated id is refused
        (ValueError) with nothing changed.
        """
        kernels, at, given, resume = compiled.kernels, np.empty(ids.size, np.int64), compiled.no_rows, False
        start = self._n
        if ids.size == 0:
            return 0
        while True:
            s1, s2 = (self._state + [compiled.no_rows] * 2)[:2]
            room = min(self.capacity, int(MAX_LOAD * self._slots.size), 2**31 - 1)
            status, value = kernels.apply(
                *(self._index(), (self._rows, s1, s2, self._meta["seen_step"]), self._n, room, ids, grads),
                *(compiled.hyper(float(lr), step), compiled.opt, step, compiled.init),
                *(given, at, resume),
            )
            if status == kernels.DONE:
                self._n = value
                return value - start
            if status == kernels.REPEATED:
                raise ValueError(
                    f"table {self.spec.name!r}: id {int(ids[value])} appears twice in one update; "
                    f"ids must be unique (see merge_duplicates)"
                )
            self._reserve(self._n + value)
            if compiled.given:
                new = ids[at < 0]
                given = given_rows(new, np.empty((new.size, self.spec.dim), self.dtype))
            resume = True

    def lookup_compiled(self, compiled, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``out[i]`` = the stored row of ``ids[i]`` in one compiled call
        (:func:`pserver.tables.compiled.row_kernels.lookup`); the indices of the ids not stored."""
        miss = np.empty(ids.size, np.int64)
        return miss[: compiled.kernels.lookup(self._index(), self._rows, ids, out, miss)]

    def _index(self) -> tuple:
        """(slots, ids, shift): the index as the compiled kernels take it; the shift leaves an id hash's top
        log2(slots) bits, its home slot."""
        return self._slots, self._ids, np.uint64(64 - (self._slots.size.bit_length() - 1))

    def remove(self, victims: np.ndarray) -> np.ndarray:
        """Delete the rows ``victims`` (sorted, distinct row numbers) and return their ids.

        Rows stay dense in ``[0, n)``: the live rows after the new end move
        into the holes below it (every array: ids, rows, state, metadata), and
        their index entries are re-pointed; the space after ``n`` is reused
        by the next inserts. Without numba the index is rebuilt instead.
        """
        k = victims.size
        if k == 0:
            return np.empty(0, np.int64)
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
        log.debug("table %s shard %d: removed %d rows, %d left", self.spec.name, self.shard, k, m)
        return gone

    def _reserve(self, n_rows: int) -> None:
        """Room for ``n_rows`` rows in the row arrays and the index."""
        if n_rows >= 2**31:  # row numbers are int32 in the index
            raise MemoryError(
                f"table {self.spec.name!r}: shard {self.shard} would hold {n_rows} "
                f"rows, more than 2**31 - 1; use more pservers"
            )
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
        self._state = rest[: self.n_state]
        self._meta = dict(zip(self.columns, rest[self.n_state :]))

    def _grow_rows(self, capacity: int) -> None:
        """Grow every row array to ``capacity``; our views are dropped first so maps can move."""
        self._ids = self._rows = None
        self._state, self._meta = [], {}
        try:
            for g in self._store:
                g.grow(capacity, self._n)
        finally:
            self._refresh_views()

    def insert(
        self, new_ids: np.ndarray, stop: np.ndarray, values: Optional[Sequence[np.ndarray]] = None
    ) -> np.ndarray:
        """Store absent, distinct ``new_ids``; return their row numbers.

        Without ``values`` the rows start at their initial values and state
        (metadata 0: the update that follows sets it); with ``values`` (one
        array per stored array after ids: rows, each state array, each metadata
        column, as :meth:`arrays` gives them) they are stored as given (a
        row promoted from the disk tier). ``stop`` is where their probes
        stopped; it is recomputed if the index had to be rebuilt to make room.
        Repeated new ids would each get a row and corrupt the index, so they
        are refused first (a sort of the new ids only).
        """
        if new_ids.size > 1:
            s = np.sort(new_ids)
            if (s[1:] == s[:-1]).any():
                dup = int(s[1:][s[1:] == s[:-1]][0])
                raise ValueError(
                    f"table {self.spec.name!r}: id {dup} appears twice in one update; "
                    f"ids must be unique (see merge_duplicates)"
                )
        start, m = self._n, new_ids.size
        n_slots = self._slots.size
        self._reserve(start + m)
        if self._slots.size != n_slots:
            stop = probe(self._slots, self._ids, new_ids, home_slots(new_ids, self._slots.size))[1]
        end = start + m
        self._ids[start:end] = new_ids
        if values is None:
            self._initial_into(new_ids, self._rows[start:end])
            for s, v in zip(self._state, self._state_init):
                s[start:end] = v
            for column in self._meta.values():  # score 0: the update that follows makes it 1
                column[start:end] = 0
        else:
            for a, v in zip([self._rows, *self._state, *self._meta.values()], values):
                a[start:end] = v
        rownums = np.arange(start, end, dtype=np.int32)
        place(self._slots, stop, rownums)
        self._n = end
        return rownums

    def append(
        self, ids: np.ndarray, arrays: List[np.ndarray], meta: Mapping[str, object], origin: str
    ) -> None:
        """Store saved rows (ids, [rows, *state]) as they are, refusing ids already present.

        ``meta`` gives every metadata column's values for them (an array, or
        one value for all); ``origin`` names where they come from in errors.
        """
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
            raise ValueError(
                f"table {self.spec.name!r}: id {dup} in {origin} was already loaded "
                f"from another directory; a shard directory was given twice or is corrupt"
            )
        self._ids[start:end] = ids
        self._rows[start:end] = arrays[0]
        for s, v in zip(self._state, arrays[1:]):
            s[start:end] = v
        for name, column in self._meta.items():
            column[start:end] = meta[name]
        place(self._slots, stop, rownums)
        self._n = end
        # A file repeating an id would leave two slots for one key; the second is unreachable.
        again = probe(self._slots, self._ids, ids, home_slots(ids, self._slots.size), want_stop=False)[0]
        if not np.array_equal(again, rownums):
            dup = int(ids[np.argmax(again != rownums)])
            raise ValueError(f"table {self.spec.name!r}: id {dup} appears twice in {origin}")
