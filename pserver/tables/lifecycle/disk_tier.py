"""DiskTier: fixed-size records keyed by int64 id in an embedded LMDB store on local disk.

Why LMDB (the maintained ``lmdb`` binding): an embedded, memory-mapped B+tree in
one file, with batch puts and gets looped in C (``Cursor.putmulti`` /
``Cursor.getmulti``) and reads that come straight from the page cache. Unlike
an LSM tree (RocksDB) it has no background compactions to pause or to tune,
and unlike a hand-written file format it gives crash-safe updates, free-space
reuse and ordered iteration without code of ours.

The store is a working area, not the durable copy: the table shard writes
every row, disk tier included, into its checkpoint files, and a restarted
pserver starts a fresh store. So it is opened without fsyncs (``sync=False``,
``metasync=False``): a crash loses only the working store. The shard calls
every method under its own lock, so LMDB's reader table is not needed
(``lock=False``); ``readahead=False`` because accesses are random;
``writemap=True`` writes pages in the map itself, so a commit (without
fsync) copies nothing: half the cost of a spill or promotion, measured.
Keys are the ids big-endian with the sign bit flipped, so the B+tree's byte
order is the ids' numeric order, and each batch is written sorted. ``len()``
is a count kept by this object, so it can be read from another thread.

"""
from __future__ import annotations

import errno
import logging
import os
import shutil
from typing import Iterator, Tuple

import lmdb
import numpy as np

log = logging.getLogger(__name__)

_SIGN = np.uint64(1 << 63)

# LMDB's map is this much bigger than max_bytes: deletes and overwrites copy pages on write, and
# must find room even when the records fill max_bytes.
HEADROOM = 2


class DiskTierFull(Exception):
    """A write did not fit (the disk or the store's size limit is full); nothing was written."""


class DiskTier:
    """Records of ``record_bytes`` bytes by int64 id, in a fresh LMDB store under ``directory``.

    ``max_bytes`` is LMDB's map size: the most the store may grow to.
    """

    def __init__(self, directory: str, record_bytes: int, max_bytes: int = 1 << 40):
        if record_bytes < 1:
            raise ValueError(f"record_bytes must be positive, got {record_bytes}")
        self.directory = directory
        self.record_bytes = int(record_bytes)
        self.max_bytes = int(max_bytes)
        shutil.rmtree(directory, ignore_errors=True)  # a working store: never reused
        os.makedirs(directory, exist_ok=True)
        self._env = lmdb.open(directory, map_size=HEADROOM * self.max_bytes + (1 << 20), subdir=True, sync=False,
                              metasync=False, lock=False, readahead=False, max_dbs=0, writemap=True)
        self._count = 0

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        """Bytes of the store's pages in use (live records and the tree above them)."""
        stat = self._env.stat()
        return (stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]) * stat["psize"]

    def _keys(self, ids: np.ndarray) -> list:
        ids = self._check_ids(ids)
        raw = (ids.view(np.uint64) ^ _SIGN).astype(">u8").tobytes()
        return [raw[i:i + 8] for i in range(0, len(raw), 8)]

    @staticmethod
    def _check_ids(ids) -> np.ndarray:
        ids = np.asarray(ids)
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise ValueError(f"ids must be a 1-D integer array, got {ids.dtype} {list(ids.shape)}")
        return ids.astype(np.int64, copy=False)

    def put(self, ids: np.ndarray, records: np.ndarray) -> None:
        """Store (or overwrite) the records of ``ids``, all or nothing; :class:`DiskTierFull` when full."""
        keys = self._keys(ids)
        records = np.ascontiguousarray(records).view(np.uint8).reshape(len(keys), -1) if len(keys) else records
        if len(keys) and records.shape[1] != self.record_bytes:
            raise ValueError(f"records are {records.shape[1]} bytes, this store holds {self.record_bytes}")
        # Refused before it starts when the live pages would pass max_bytes; the map's headroom above
        # it keeps deletes (promotions, sweeps) possible on a full store.
        need = len(keys) * (self.record_bytes + 24)
        if self.nbytes + need > self.max_bytes:
            raise DiskTierFull(self._full_message(len(keys), "the store's size limit"))
        order = np.argsort(self._check_ids(ids), kind="stable") if len(keys) else []
        raw = records.tobytes() if len(keys) else b""
        rb = self.record_bytes
        items = [(keys[i], raw[i * rb:(i + 1) * rb]) for i in order.tolist()] if len(keys) else []
        try:
            with self._env.begin(write=True) as txn:
                added = txn.cursor().putmulti(items)[1]
            self._count += added
        except lmdb.MapFullError:
            raise DiskTierFull(self._full_message(len(items), "the store's size limit")) from None
        except (lmdb.Error, OSError) as e:
            if getattr(e, "errno", None) == errno.ENOSPC or "No space" in str(e):
                raise DiskTierFull(self._full_message(len(items), "the disk")) from None
            raise

    def _full_message(self, n: int, what: str) -> str:
        return (f"disk tier {self.directory}: {n} records of {self.record_bytes} B did not fit, {what} is "
                f"full ({self.nbytes:,} B in use, limit {self.max_bytes:,} B); free disk space, move "
                f"table_disk_dir, or raise the table's ram_rows")

    def get(self, ids: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(found per id, records (len(ids), record_bytes) with zeros where not found)."""
        return self._read(ids, delete=False)

    def pop(self, ids: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """As :meth:`get`, and the found records are deleted, in one transaction."""
        return self._read(ids, delete=True)

    def _read(self, ids: np.ndarray, delete: bool) -> Tuple[np.ndarray, np.ndarray]:
        keys = self._keys(ids)
        found = np.zeros(len(keys), dtype=bool)
        out = np.zeros((len(keys), self.record_bytes), dtype=np.uint8)
        if not keys:
            return found, out
        with self._env.begin(write=delete) as txn:
            got = dict(txn.cursor().getmulti(keys))
            if delete:
                for k in got:
                    txn.delete(k)
        if delete:
            self._count -= len(got)
        if got:
            hit = [i for i, k in enumerate(keys) if k in got]
            found[hit] = True
            out[hit] = np.frombuffer(b"".join(got[keys[i]] for i in hit), dtype=np.uint8).reshape(len(hit), -1)
        return found, out

    def delete(self, ids: np.ndarray) -> int:
        """Delete the records of ``ids``; how many there were."""
        keys = self._keys(ids)
        n = 0
        with self._env.begin(write=True) as txn:
            for k in keys:
                n += txn.delete(k)
        self._count -= n
        return n

    def iter_chunks(self, chunk: int = 1 << 16) -> Iterator[Tuple[np.ndarray, np.ndarray]]:
        """(ids, records) of every record, ``chunk`` at a time, in id-byte order, from one snapshot."""
        with self._env.begin() as txn:
            keys, values = [], []
            for k, v in txn.cursor():
                keys.append(k)
                values.append(v)
                if len(keys) == chunk:
                    yield self._chunk(keys, values)
                    keys, values = [], []
            if keys:
                yield self._chunk(keys, values)

    def _chunk(self, keys, values):
        ids = (np.frombuffer(b"".join(keys), dtype=">u8").astype(np.uint64) ^ _SIGN).view(np.int64)
        return ids, np.frombuffer(b"".join(values), dtype=np.uint8).reshape(len(keys), self.record_bytes).copy()

    def close(self) -> None:
        """Close the store and remove its files."""
        if self._env is not None:
            self._env.close()
            self._env = None
            shutil.rmtree(self.directory, ignore_errors=True)
