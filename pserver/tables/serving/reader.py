"""Read serving exports of distributed tables with numpy alone: newest base, then its deltas.

This one file is the whole reader. It imports only the standard library and
numpy (never torch, grpc or this repository's packages), so a serving host
copies it, or loads it by path, and needs nothing else. The exports are
written by :mod:`pserver.tables.serving.exports`, whose docstring has the format::

    ROOT/<step:012d>-<base|delta>/<table>/shard-K-of-N/{ids,rows,tombstones}.npy, meta.json
    ROOT/<step:012d>-<base|delta>/DONE.shard-K-of-N, DONE

An export counts only once its ``DONE`` exists (every pserver finished it).
:meth:`ServingTables.refresh` loads the newest complete base, then applies
every complete delta whose ``previous`` names the export applied last, in
step order; it stops at a delta that follows another one not yet complete
and at a broken link. An incomplete delta that a later complete delta skips
(its ``previous`` is the loaded export) was abandoned by a crashed writer,
so the chain goes on past it. An export missing a shard, with shards that
disagree, or with unreadable files is refused and logged, never half applied:
each refresh builds new arrays and swaps them in with one assignment, so
lookups from other threads see the old state or the new one.

Each table is a sorted int64 id array and the matching rows; a lookup is one
``searchsorted``, a delta one ``isin`` plus one ``argsort``.

CLI: ``python reader.py ROOT TABLE ID [ID ...]`` prints each id's row.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from typing import Dict, List, Optional, Tuple

import numpy as np

__all__ = ["ServingTables", "ExportError", "main"]

log = logging.getLogger(__name__)

FORMAT = "torch-pserver-export"
VERSION = 1
DTYPES = ("float32", "float64")
_NAME = re.compile(r"^(\d{12})-(base|delta)$")
_DONE_SHARD = re.compile(r"^DONE\.shard-(\d+)-of-(\d+)$")
_SHARD_DIR = re.compile(r"^shard-(\d+)-of-(\d+)$")
_META_KEYS = ("table", "dim", "dtype", "kind", "step", "previous", "shard", "n_shards", "rows", "tombstones")

Table = Tuple[np.ndarray, np.ndarray]  # sorted int64 ids (n,), rows (n, dim)


class ExportError(ValueError):
    """An export that is complete but cannot be applied (missing shard, mismatched files)."""


def _exports(root: str) -> List[Tuple[int, str, str]]:
    """``(step, kind, name)`` of every export directory under ``root``, in step order."""
    try:
        entries = os.listdir(root)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), m.group(2), e) for e in entries if (m := _NAME.match(e))]
    return sorted(found)


def _complete(root: str, name: str) -> bool:
    return os.path.exists(os.path.join(root, name, "DONE"))


def _open_shard(directory: str, table: str, shard: int, n_shards: int, name: str) -> dict:
    """The checked meta of one shard directory, with its arrays memory-mapped under ``arrays``."""
    try:
        with open(os.path.join(directory, "meta.json"), "rb") as f:
            meta = json.loads(f.read())
    except (OSError, ValueError) as e:
        raise ExportError(f"{directory}: meta.json unreadable ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ExportError(f"{directory}: meta.json is not a {FORMAT} version {VERSION} meta")
    missing = [k for k in _META_KEYS if k not in meta]
    if missing:
        raise ExportError(f"{directory}: meta.json lacks {missing}")
    m = _NAME.match(name)
    want = {"table": table, "shard": shard, "n_shards": n_shards, "step": int(m.group(1)), "kind": m.group(2)}
    for key, value in want.items():
        if meta[key] != value:
            raise ExportError(f"{directory}: meta.json says {key} {meta[key]!r}, its place says {value!r}")
    if meta["dtype"] not in DTYPES or not (isinstance(meta["dim"], int) and meta["dim"] >= 1):
        raise ExportError(f"{directory}: dtype {meta['dtype']!r} / dim {meta['dim']!r} not servable")
    if meta["kind"] == "base" and (meta["previous"] is not None or meta["tombstones"]):
        raise ExportError(f"{directory}: a base with a previous export or tombstones")
    shapes = {
        "ids": ((meta["rows"],), np.dtype(np.int64)),
        "rows": ((meta["rows"], meta["dim"]), np.dtype(meta["dtype"])),
        "tombstones": ((meta["tombstones"],), np.dtype(np.int64)),
    }
    arrays = {}
    for label, (shape, dtype) in shapes.items():
        path = os.path.join(directory, f"{label}.npy")
        try:
            a = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise ExportError(f"{path}: unreadable ({e})") from None
        if a.shape != shape or a.dtype != dtype:
            raise ExportError(
                f"{path}: holds {a.dtype} {list(a.shape)}, meta.json says {dtype} {list(shape)}"
            )
        arrays[label] = a
    meta["arrays"] = arrays
    return meta


def _open_export(root: str, name: str) -> dict:
    """Every table of complete export ``name``, checked: ``{"previous", "tables": {table: [shard metas]}}``.

    Refuses (ExportError) pservers that disagree on the shard count, a table
    without all N shard directories, and shards that disagree with each other.
    """
    export_dir = os.path.join(root, name)
    counts = {}
    for entry in os.listdir(export_dir):
        m = _DONE_SHARD.match(entry)
        if m:
            counts.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
    if len(counts) != 1:
        raise ExportError(
            f"{export_dir}: DONE.shard files give shard counts {sorted(counts)}; "
            f"all pservers of one export must agree"
        )
    ((n_shards, done),) = counts.items()
    if done != set(range(n_shards)):
        raise ExportError(f"{export_dir}: DONE but only DONE.shard {sorted(done)} of {n_shards}")
    tables: Dict[str, list] = {}
    for table in sorted(os.listdir(export_dir)):
        folder = os.path.join(export_dir, table)
        if not os.path.isdir(folder):
            continue
        present = {}
        for entry in os.listdir(folder):
            m = _SHARD_DIR.match(entry)
            if m:
                if int(m.group(2)) != n_shards:
                    raise ExportError(f"{folder}: {entry} in an export of {n_shards} pservers")
                present[int(m.group(1))] = os.path.join(folder, entry)
        missing = [f"shard-{k}-of-{n_shards}" for k in range(n_shards) if k not in present]
        if missing:
            raise ExportError(f"{folder}: shard directories {missing} are missing")
        metas = [_open_shard(present[k], table, k, n_shards, name) for k in range(n_shards)]
        for key in ("dim", "dtype", "previous"):
            if len({repr(m[key]) for m in metas}) != 1:
                raise ExportError(f"{folder}: shards disagree on {key}: {[m[key] for m in metas]}")
        tables[table] = metas
    if not tables:
        raise ExportError(f"{export_dir}: holds no tables")
    previous = {repr(metas[0]["previous"]) for metas in tables.values()}
    if len(previous) != 1:
        raise ExportError(f"{export_dir}: tables disagree on the previous export: {sorted(previous)}")
    return {"previous": next(iter(tables.values()))[0]["previous"], "tables": tables}


def _merge(where: str, metas: list, old: Optional[Table]) -> Table:
    """``old`` (None: empty) with one table's export shards applied: tombstoned and rewritten ids
    dropped, written rows added, sorted by id once."""
    ids = np.concatenate([m["arrays"]["ids"] for m in metas])
    rows = np.concatenate([m["arrays"]["rows"] for m in metas])
    dead = np.concatenate([m["arrays"]["tombstones"] for m in metas])
    if old is not None:
        if old[1].shape[1] != rows.shape[1] or old[1].dtype != rows.dtype:
            raise ExportError(
                f"{where}: rows are {rows.dtype} dim {rows.shape[1]}, the loaded table "
                f"{old[1].dtype} dim {old[1].shape[1]}"
            )
        keep = ~np.isin(old[0], np.concatenate([ids, dead]))
        ids = np.concatenate([old[0][keep], ids])
        rows = np.concatenate([old[1][keep], rows])
    order = np.argsort(ids, kind="stable")
    ids, rows = ids[order], rows[order]
    twice = ids[1:][ids[1:] == ids[:-1]]
    if twice.size:
        raise ExportError(f"{where}: ids {twice[:8].tolist()} are written by more than one shard")
    if dead.size and np.isin(dead, ids).any():
        raise ExportError(
            f"{where}: ids {dead[np.isin(dead, ids)][:8].tolist()} are both written and tombstoned"
        )
    return ids, rows


class ServingTables:
    """The tables of the newest complete export chain under ``root``; nothing is read until
    :meth:`refresh`."""

    def __init__(self, root: str):
        self.root = root
        # One tuple, replaced whole: (tables, name of the last applied export, its step).
        self._state: Tuple[Dict[str, Table], Optional[str], int] = ({}, None, -1)

    @property
    def loaded(self) -> Optional[str]:
        """Name of the last export applied, None before the first successful refresh."""
        return self._state[1]

    def _apply(self, name: str, export: dict, tables: Dict[str, Table]) -> Dict[str, Table]:
        base = _NAME.match(name).group(2) == "base"
        new = {} if base else dict(tables)
        for table, metas in export["tables"].items():
            new[table] = _merge(f"{name}/{table}", metas, None if base else tables.get(table))
        return new

    def refresh(self) -> List[str]:
        """Advance to the newest state under ``root``; return the names of the exports applied.

        A complete base newer than the loaded export replaces everything (the
        newest that reads cleanly); then complete deltas newer than the loaded
        export are applied in step order while each one's ``previous`` is the
        export applied before it. Deltas already applied are not read again.
        Each stop (incomplete, broken link, corrupt export) is logged.
        """
        tables, loaded, loaded_step = self._state
        applied: List[str] = []
        exports = _exports(self.root)
        complete = {name for _, _, name in exports if _complete(self.root, name)}
        for step, kind, name in reversed(exports):
            if step <= loaded_step:
                break
            if kind == "base" and name in complete:
                try:
                    tables = self._apply(name, _open_export(self.root, name), {})
                except (ExportError, OSError) as e:
                    log.warning("serving exports: base %s refused: %s", name, e)
                    continue
                loaded, loaded_step, applied = name, step, [name]
                break
        if loaded is None:
            log.info("serving exports: no complete base under %s yet", self.root)
            return []
        waiting = set()
        for step, kind, name in exports:
            if step <= loaded_step:
                continue
            if name not in complete:
                waiting.add(name)  # in progress, or abandoned if a later delta follows `loaded`
                continue
            if kind == "base":
                continue  # complete yet not loaded above: refused, and logged there
            try:
                export = _open_export(self.root, name)
                if export["previous"] != loaded:
                    # Following an export still being written is normal; any other link is broken.
                    pending = export["previous"] in waiting
                    log.log(
                        logging.INFO if pending else logging.WARNING,
                        "serving exports: stopping at delta %s: it %s %s, but the loaded export is %s",
                        name,
                        "waits for incomplete export" if pending else "follows",
                        export["previous"],
                        loaded,
                    )
                    break
                tables = self._apply(name, export, tables)
            except (ExportError, OSError) as e:
                log.warning("serving exports: stopping at delta %s, refused: %s", name, e)
                break
            loaded, loaded_step = name, step
            applied.append(name)
        if waiting and not applied:
            log.info("serving exports: %s not complete yet; staying at %s", sorted(waiting), loaded)
        self._state = (tables, loaded, loaded_step)
        if applied:
            log.info("serving exports: applied %s under %s", applied, self.root)
        return applied

    def tables(self) -> List[str]:
        """Names of the loaded tables, sorted."""
        return sorted(self._state[0])

    def _table(self, table: str) -> Table:
        tables = self._state[0]
        if table not in tables:
            raise KeyError(f"no table {table!r} loaded (tables {sorted(tables)}, export {self.loaded})")
        return tables[table]

    def lookup(self, table: str, ids) -> Tuple[np.ndarray, np.ndarray]:
        """Rows ``(n, dim)`` of ``ids`` in ``table`` and a bool ``found`` per id; absent ids get zeros."""
        known, rows = self._table(table)
        ids = np.asarray(ids).reshape(-1)
        if ids.size and ids.dtype.kind not in "iu":
            raise ValueError(f"ids must be integers, got dtype {ids.dtype}")
        ids = ids.astype(np.int64, copy=False)
        pos = np.minimum(np.searchsorted(known, ids), max(known.size - 1, 0))
        found = known[pos] == ids if known.size else np.zeros(ids.size, bool)
        out = np.zeros((ids.size, rows.shape[1]), rows.dtype)
        out[found] = rows[pos[found]]
        return out, found

    def ids(self, table: str) -> np.ndarray:
        """Every live id of ``table``, sorted (a read-only view)."""
        ids = self._table(table)[0].view()
        ids.flags.writeable = False
        return ids

    def rows(self, table: str) -> int:
        """Number of live rows of ``table``."""
        return int(self._table(table)[0].size)

    def __len__(self) -> int:
        """Live rows of all tables together."""
        return sum(int(ids.size) for ids, _ in self._state[0].values())


def main(argv=None) -> int:
    """``reader.py ROOT TABLE ID [ID ...]``: print each id's row from the newest export."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 3:
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        print("usage: reader.py ROOT TABLE ID [ID ...]", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    root, table, raw = argv[0], argv[1], argv[2:]
    try:
        ids = np.array([int(i) for i in raw], np.int64)
    except ValueError:
        print(f"error: ids must be integers, got {raw}", file=sys.stderr)
        return 2
    reader = ServingTables(root)
    reader.refresh()
    if reader.loaded is None:
        print(f"error: no complete export under {root}", file=sys.stderr)
        return 1
    try:
        rows, found = reader.lookup(table, ids)
    except KeyError as e:
        print(f"error: {e.args[0]}", file=sys.stderr)
        return 1
    print(f"# {reader.loaded}: table {table}, {reader.rows(table)} rows of dim {rows.shape[1]}")
    for i, row, ok in zip(ids.tolist(), rows, found.tolist()):
        # repr(float) round-trips, so the printed row is exactly the stored one.
        print(f"{i}\t" + (" ".join(repr(float(v)) for v in row) if ok else "not found"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
