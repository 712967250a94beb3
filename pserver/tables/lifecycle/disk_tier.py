"""DiskTier: fixed-size records keyed by int64 id, in an embedded LMDB store on local disk.

A table with a RAM budget spills its cold rows here and promotes them back on
access. Records are opaque ``record_bytes``-byte strings (row, optimizer state
and metadata packed by the caller), one per int64 id.

Why LMDB (the maintained ``lmdb`` binding) rather than a file format of our
own: embedded, one data file, a copy-on-write B+tree that gives all-or-nothing
batches, free-page reuse and snapshot iteration for free, reads straight from
the memory map, and batch loops in C (``Cursor.putmulti``; ``map`` over
``Cursor.get``/``pop``). Unlike an LSM tree (RocksDB) it has no background
compactions to tune or to pause a training step.

Options, and why:

- ``sync=False, metasync=False``: a working area, never the durable copy (the
  caller checkpoints separately): a crash may lose it, so no fsync is paid.
- ``writemap=False``: with ``writemap`` the data file is a sparse file the size
  of the map, written through the map, so a full disk is a SIGBUS that kills
  the pserver (py-lmdb issue #161). Without it a commit writes with ``pwrite``
  and a full disk is an error, turned into :class:`DiskTierFull` (checked on a
  256 KiB tmpfs); it was no slower, measured. ``map_async`` needs ``writemap``.
- ``readahead=False``: promotions are random lookups; readahead would fill the
  page cache with neighbours nobody asked for. ``max_dbs=0``: one database.
- ``lock=True``: the caller serialises every call with its own lock, so this
  class keeps no lock of its own, no write transaction ever waits for another,
  and a transaction may start in one thread and end in another (py-lmdb opens
  with ``MDB_NOTLS``). But :meth:`iter_chunks` holds a read snapshot *across*
  calls while puts and pops go on, and LMDB's reader table is what keeps
  writers off the pages it still reads: with ``lock=False`` that test aborted
  the process (an assertion in ``mdb_cursor_sibling``). Cost: an uncontended
  mutex per write transaction.

Keys are the ids big-endian with the sign bit flipped, so the tree's order is
the ids' numeric order; every batch is sorted first (stably: the last of
repeated ids in a put wins) and walks the tree in order, 1.5-2x faster,
measured. Records over ~2 KB (half a 4 KiB page) take whole overflow pages.

Capacity: pages are copied on write, so deleting k records first needs up to k
fresh pages; on a map filled to the brim even a promotion fails. So puts are
refused once the live pages would pass half of ``max_bytes`` (the map size, a
hard bound on the data file), leaving the rest for pops, deletes and the pages
a snapshot pins. Random-id batches keep the file at ~2-3x the live pages.
"""

from __future__ import annotations

import errno
import logging
import operator
import os
from contextlib import contextmanager
from itertools import islice, repeat
from typing import Iterator, Tuple

import lmdb
import numpy as np

log = logging.getLogger(__name__)

_SIGN = np.uint64(1 << 63)
_FILES = ("data.mdb", "lock.mdb")


class DiskTierFull(Exception):
    """A write did not fit (the store's size limit or the disk is full); nothing was changed."""


class _OverLimit(Exception):
    pass  # aborts a put's transaction: the live pages would pass half of max_bytes


def _is_disk_full(e: BaseException, directory: str, need: int) -> bool:
    # ENOSPC comes as lmdb.DiskError only when a commit's first write fails; LMDB reports a write cut short by
    # the disk filling up as EIO (seen on a full tmpfs). So a write error with the disk (nearly) full is too.
    if isinstance(e, lmdb.DiskError) or errno.ENOSPC in (getattr(e, "errno", None), getattr(e, "code", None)):
        return True
    try:
        vfs = os.statvfs(directory)
    except OSError:
        return False
    return vfs.f_bavail * vfs.f_frsize < max(need, 1 << 20)


def _keys(ids: np.ndarray) -> list:
    # One vectorised encode, then numpy's own C loop splits it into 8-byte bytes objects.
    return (ids.view(np.uint64) ^ _SIGN).astype(">u8").view("V8").tolist()


def _records_1d(a: np.ndarray) -> np.ndarray:
    # (m, w) uint8 seen as (m,) opaque w-byte items: fancy indexing moves whole records, 2x faster than rows.
    return a.view(f"V{a.shape[1]}").reshape(-1)


def _live_bytes(stat: dict) -> int:
    return (stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]) * stat["psize"]


def _ids_of(raw: bytes) -> np.ndarray:
    return (np.frombuffer(raw, dtype=">u8").astype(np.uint64) ^ _SIGN).view(np.int64)


class DiskTier:
    """Records of ``record_bytes`` bytes by int64 id, in a fresh LMDB store under ``directory``; ``max_bytes``
    is LMDB's map size (puts refused past half of it). Not thread-safe: the caller serialises every call."""

    def __init__(self, directory: str, record_bytes: int, max_bytes: int = 1 << 40):
        if int(record_bytes) < 1:
            raise ValueError(f"record_bytes must be a positive integer, got {record_bytes!r}")
        self.directory = os.fspath(directory)
        self.record_bytes = int(record_bytes)
        self.max_bytes = int(max_bytes)
        self._env = None
        os.makedirs(self.directory, exist_ok=True)
        self._open()
        log.info(
            "disk tier %s: fresh LMDB store, %d-byte records, map %d bytes",
            self.directory,
            self.record_bytes,
            self.max_bytes,
        )

    def _open(self) -> None:
        self._remove_files()  # a working area: whatever a previous run left is stale
        self._env = lmdb.open(
            self.directory,
            map_size=self.max_bytes,
            subdir=True,
            sync=False,
            metasync=False,
            writemap=False,
            map_async=False,
            readahead=False,
            max_dbs=0,
            lock=True,
        )

    def _remove_files(self) -> None:
        # Only LMDB's two files: the directory may be shared, so it is never removed wholesale.
        for name in _FILES:
            try:
                os.remove(os.path.join(self.directory, name))
            except FileNotFoundError:
                pass

    def _live(self) -> lmdb.Environment:
        if self._env is None:
            raise ValueError(f"disk tier {self.directory} is closed")
        return self._env

    def __len__(self) -> int:
        return self._live().stat()["entries"]

    @property
    def nbytes(self) -> int:
        """Bytes of the data file in use: its highest page so far times the page size (freed pages are
        reused)."""
        env = self._live()
        return (env.info()["last_pgno"] + 1) * env.stat()["psize"]

    def _check_ids(self, ids) -> np.ndarray:
        a = np.asarray(ids)
        if a.ndim != 1 or a.dtype.kind not in "iu":
            raise ValueError(f"ids must be a 1-D integer array, got dtype {a.dtype} shape {a.shape}")
        if a.dtype == np.uint64 and a.size and a.max() > np.iinfo(np.int64).max:
            raise ValueError("ids must fit in int64; got a uint64 id above 2**63 - 1")
        return a.astype(np.int64, copy=False)

    def _check_records(self, records, n: int) -> np.ndarray:
        r = np.asarray(records)
        if r.dtype.hasobject or r.ndim == 0 or r.shape[0] != n:
            raise ValueError(
                f"records must be an array of {n} rows (one per id), got dtype {r.dtype} shape {r.shape}"
            )
        width = r.itemsize * int(np.prod(r.shape[1:], dtype=np.int64))
        if width != self.record_bytes:
            raise ValueError(f"records are {width} bytes per row, this store holds {self.record_bytes}")
        return np.ascontiguousarray(r).view(np.uint8).reshape(n, self.record_bytes)

    def _full(self, what: str) -> DiskTierFull:
        live = _live_bytes(self._live().stat())
        msg = (
            f"disk tier {self.directory}: {what} is full ({len(self)} records, {live:,} B live, data file "
            f"{self.nbytes:,} B, max_bytes {self.max_bytes:,} B, records refused past half); nothing was "
            f"written. Free disk space there or raise max_bytes."
        )
        log.warning("%s", msg)
        return DiskTierFull(msg)

    @contextmanager
    def _write(self, need: int = 0):
        # The inner `with` aborts the transaction on any exception, so a failed write changes nothing.
        try:
            with self._live().begin(write=True) as txn:
                yield txn
        except lmdb.MapFullError:
            raise self._full("the LMDB map (max_bytes)") from None
        except _OverLimit:
            raise self._full("the record limit (half of max_bytes)") from None
        except (lmdb.Error, OSError) as e:
            if _is_disk_full(e, self.directory, need):
                raise self._full("the disk") from e
            raise

    def put(self, ids: np.ndarray, records: np.ndarray) -> None:
        """Store or overwrite the records of ``ids`` (int64 (n,)) from ``records`` (n rows of ``record_bytes``
        bytes, any C-contiguous dtype) in one transaction: all or nothing, :class:`DiskTierFull` when full."""
        ids = self._check_ids(ids)
        rows = self._check_records(records, len(ids))
        if not len(ids):
            return
        order = np.argsort(ids, kind="stable")
        items = zip(_keys(ids[order]), _records_1d(rows)[order].tolist())
        with self._write(need=len(ids) * self.record_bytes) as txn:
            txn.cursor().putmulti(items)
            if _live_bytes(txn.stat()) > self.max_bytes // 2:
                raise _OverLimit()

    def _scatter(self, values: list, order: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        # values[i] is the record of sorted id i or None; both results are put back in the callers' order.
        n = len(values)
        hit = np.fromiter(map(operator.is_not, values, repeat(None)), dtype=bool, count=n)
        found = np.zeros(n, dtype=bool)
        out = np.zeros((n, self.record_bytes), dtype=np.uint8)
        rows = order[hit]
        found[rows] = True
        if rows.size:
            got = np.frombuffer(b"".join(filter(None, values)), dtype=np.uint8).reshape(-1, self.record_bytes)
            _records_1d(out)[rows] = _records_1d(got)
        return found, out

    def get(self, ids: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(found bool (n,), records uint8 (n, record_bytes)) for ``ids``, zeros where not found; repeats
        allowed."""
        ids = self._check_ids(ids)
        order = np.argsort(ids, kind="stable")
        # map over Cursor.get rather than Cursor.getmulti: both loop in C, but getmulti drops missing keys and
        # returns (key, value) tuples, so finding which ids hit means matching keys back: 1.5x slower,
        # measured.
        with self._live().begin() as txn:
            values = list(map(txn.cursor().get, _keys(ids[order])))
        return self._scatter(values, order)

    def pop(self, ids: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """As :meth:`get`, and the found records are deleted, in one write transaction; ``ids`` distinct (of a
        repeated id only the first is found)."""
        ids = self._check_ids(ids)
        order = np.argsort(ids, kind="stable")
        with self._write() as txn:
            values = list(map(txn.cursor().pop, _keys(ids[order])))
        return self._scatter(values, order)

    def delete(self, ids: np.ndarray) -> int:
        """Delete the records of ``ids`` in one write transaction; returns how many there were."""
        ids = self._check_ids(ids)
        with self._write() as txn:
            return sum(map(txn.delete, _keys(np.sort(ids))))

    def iter_chunks(self, chunk: int = 1 << 16) -> Iterator[Tuple[np.ndarray, np.ndarray]]:
        """Yield (ids int64 (m,), records uint8 (m, record_bytes)), m <= ``chunk``, covering every record once
        in id order, from a read snapshot taken by this call: later writes are not seen. The snapshot is held
        until the generator ends or is closed; :meth:`clear` and :meth:`close` invalidate it."""
        if chunk < 1:
            raise ValueError(f"chunk must be positive, got {chunk}")
        return self._chunks(self._live().begin(), chunk)

    def _chunks(self, txn: lmdb.Transaction, chunk: int) -> Iterator[Tuple[np.ndarray, np.ndarray]]:
        with txn:
            items = txn.cursor().iternext()
            while batch := list(islice(items, chunk)):
                keys, values = zip(*batch)
                # bytearray.join: one copy, and the caller gets a writable array.
                records = np.frombuffer(bytearray().join(values), dtype=np.uint8).reshape(
                    -1, self.record_bytes
                )
                yield _ids_of(b"".join(keys)), records

    def clear(self) -> None:
        """Remove every record and give the disk space back (the store is recreated empty)."""
        self._live().close()
        self._open()

    def close(self) -> None:
        """Close the store and remove its files; idempotent."""
        if self._env is not None:
            self._env.close()
            self._env = None
            self._remove_files()
