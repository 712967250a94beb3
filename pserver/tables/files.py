"""Files of distributed-table shards: atomic save, re-sharding load (their export: :mod:`.plain_files`).

A save of a job's tables (``Trainer.save_tables(ROOT)``) puts shard K of N of
table T in ``ROOT/T/shard-K-of-N`` (:func:`shard_directory`). A saved shard is
one directory::

    ids.npy       int64 (n,)          the stored ids, in row order
    rows.npy      dtype (n, dim)      their rows
    <state>.npy   dtype (n, dim)      one per optimizer state array ("sum" for
                                      adagrad, "exp_avg" and "exp_avg_sq" for adam)
    <column>.npy  (n,)                row metadata (:mod:`pserver.tables.lifecycle`):
                                      seen_step always, score / seen_time with their rules
    sketch.npy    uint16 (4, width)   the admission counts (``admit_count`` > 1); a
                                      re-shard sums the saved shards' sketches
    meta.json     table, dim, dtype, optimizer, step, rows, shard, n_shards,
                  routing (the version of :mod:`transpiler.layout.routing` that placed the
                  ids; absent: 1), format version and the full table spec (init, seed, ...)

Only stored rows are written, never spare capacity. Every file goes to a
temporary name in the same directory, is fsynced and renamed; an old
``meta.json`` is removed first and the new one written last, so a directory
whose save was interrupted has no ``meta.json`` and is refused, never half
read. (Saving over the only copy of a checkpoint therefore loses it if the
save is interrupted: save each checkpoint into a fresh directory.)

Loading memory-maps the files (``np.load(mmap_mode="r")``) and copies the
selected ids chunk by chunk, so a big shard set needs no second copy in memory.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Iterator, List, Sequence, Tuple

import numpy as np

from psproto.dtypes import TABLE_DTYPES
from transpiler.layout.routing import ROUTING_VERSION
from transpiler.tables import TableSpec, shard_of

from .. import atomic_files
from .lifecycle import META_COLUMNS
from .sparse_optim import STATE_NAMES

__all__ = [
    "FORMAT",
    "VERSION",
    "shard_meta",
    "write_shard",
    "open_shards",
    "iter_selected",
    "read_source",
    "check_set",
    "shard_directory",
    "saved_shards",
    "Source",
]

log = logging.getLogger(__name__)

FORMAT = "torch-pserver-table-shard"
VERSION = 1
META = "meta.json"


def shard_directory(root: str, table: str, shard: int, n_shards: int) -> str:
    """Where shard ``shard`` of ``n_shards`` of ``table`` is saved under ``root``."""
    return os.path.join(root, table, f"shard-{shard}-of-{n_shards}")


def saved_shards(root: str, table: str) -> List[str]:
    """Every saved shard directory of ``table`` under ``root`` (any shard count), sorted."""
    folder = os.path.join(root, table)
    if not os.path.isdir(folder):
        raise ValueError(f"no saved shards of table {table!r} under {root!r} (no folder {folder})")
    found = sorted(os.path.join(folder, d) for d in os.listdir(folder) if d.startswith("shard-"))
    if not found:
        raise ValueError(f"no saved shards of table {table!r} in {folder}")
    return found


def shard_meta(
    spec: TableSpec,
    shard: int,
    n_shards: int,
    step: int,
    rows: int,
    arrays: Sequence[str] = (),
    extra: Sequence[str] = (),
) -> dict:
    """The ``meta.json`` of one saved shard: ``arrays`` hold one entry per row, ``extra`` do not."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "table": spec.name,
        "dim": spec.dim,
        "dtype": spec.dtype,
        "optimizer": spec.optimizer.name,
        "step": int(step),
        "rows": int(rows),
        "shard": int(shard),
        "n_shards": int(n_shards),
        "routing": ROUTING_VERSION,
        "arrays": list(arrays) or ["ids", "rows", *STATE_NAMES[spec.optimizer.name]],
        "extra": list(extra),
        "spec": spec.to_dict(),
    }


@dataclass
class Chunked:
    """An array written part by part (``parts()`` yields them in order), never whole in memory.

    A shard with a disk tier saves its rows on disk this way, chunk by chunk.
    """

    length: int
    tail: Tuple[int, ...]
    dtype: np.dtype
    parts: Callable[[], Iterable[np.ndarray]]


def _write_array(path: str, array) -> None:
    """``array`` (an ndarray or :class:`Chunked`) as a ``.npy`` file at ``path``, atomically."""
    if not isinstance(array, Chunked):
        atomic_files.atomic_write(path, lambda f: np.save(f, array, allow_pickle=False))
        return
    with atomic_files.replacing(path) as tmp:
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=array.dtype, shape=(array.length, *array.tail))
        at = 0
        for part in array.parts():
            out[at : at + len(part)] = part
            at += len(part)
        if at != array.length:
            raise RuntimeError(f"{path}: {at} rows written, {array.length} expected")
        out.flush()
        del out


def write_shard(
    directory: str, arrays: Dict[str, np.ndarray], meta: dict, extra: Dict[str, np.ndarray] = None
) -> None:
    """Write ``arrays`` (and ``extra``) as ``<name>.npy`` and then ``meta.json`` into ``directory``,
    atomically.

    The previous ``meta.json`` is removed before any array is replaced, so no moment exists at which a meta
    describes arrays of another save.
    """
    os.makedirs(directory, exist_ok=True)
    meta_path = os.path.join(directory, META)
    if os.path.exists(meta_path):
        os.unlink(meta_path)
        atomic_files.fsync_dir(directory)
    for name, array in {**arrays, **(extra or {})}.items():
        _write_array(os.path.join(directory, f"{name}.npy"), array)
    atomic_files.fsync_dir(directory)
    atomic_files.write_json(meta_path, meta)
    atomic_files.fsync_dir(directory)
    log.info(
        "table %s: saved shard %d/%d (%d rows, step %d) to %s",
        meta["table"],
        meta["shard"],
        meta["n_shards"],
        meta["rows"],
        meta["step"],
        directory,
    )


@dataclass
class Source:
    """One saved shard directory, validated: its meta and memory-mapped arrays."""

    directory: str
    meta: dict
    arrays: Dict[str, np.ndarray]
    extra: Dict[str, np.ndarray]

    @property
    def rows(self) -> int:
        return self.meta["rows"]


def read_source(directory: str) -> Source:
    """Read and check one shard directory against its own meta (not yet against a spec)."""
    meta_path = os.path.join(directory, META)
    if not os.path.isfile(meta_path):
        raise ValueError(
            f"{directory}: no {META}; not a saved table shard, or its save was "
            f"interrupted (meta.json is written last)"
        )
    try:
        with open(meta_path, "rb") as f:
            meta = json.loads(f.read())
    except (OSError, ValueError) as e:
        raise ValueError(f"{meta_path}: unreadable ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(
            f"{meta_path}: not a table shard meta (format {meta.get('format')!r})"
            if isinstance(meta, dict)
            else f"{meta_path}: not a table shard meta"
        )
    if meta.get("version") != VERSION:
        raise ValueError(f"{meta_path}: format version {meta.get('version')}, this build reads {VERSION}")
    for key in ("table", "dim", "dtype", "optimizer", "step", "rows", "shard", "n_shards", "arrays"):
        if key not in meta:
            raise ValueError(f"{meta_path}: missing field {key!r}")
    if meta["dtype"] not in TABLE_DTYPES:
        raise ValueError(f"{meta_path}: dtype {meta['dtype']!r} is not one of {sorted(TABLE_DTYPES)}")
    dtype = np.dtype(meta["dtype"])
    n, dim = meta["rows"], meta["dim"]
    arrays = {}
    for name in meta["arrays"]:
        path = os.path.join(directory, f"{name}.npy")
        if not os.path.isfile(path):
            raise ValueError(f"{directory}: {name}.npy is missing")
        a = np.load(path, mmap_mode="r", allow_pickle=False)
        if name == "ids":
            want = ((n,), np.dtype(np.int64))
        elif name in META_COLUMNS:
            want = ((n,), META_COLUMNS[name])
        else:
            want = ((n, dim), dtype)
        if a.shape != want[0] or a.dtype != want[1]:
            raise ValueError(
                f"{path}: holds {a.dtype} {list(a.shape)}, but {META} says "
                f"{want[1]} {list(want[0])} (rows {n}); files of different saves?"
            )
        arrays[name] = a
    extra = {}
    for name in meta.get("extra", []):
        path = os.path.join(directory, f"{name}.npy")
        if not os.path.isfile(path):
            raise ValueError(f"{directory}: {name}.npy is missing")
        extra[name] = np.load(path, allow_pickle=False)
    return Source(directory, meta, arrays, extra)


def saved_routing(meta: dict) -> int:
    """The routing version that placed a saved shard's ids (files saved before versions: 1)."""
    return int(meta.get("routing", 1))


def check_set(sources: List[Source]) -> Tuple[int, int]:
    """The saved shard count all ``sources`` must share, and their highest step; refuse repeats and a set
    whose shards were placed by different routings.

    Steps may differ: an async job's shards apply their trainers' pushes
    independently, so a save can catch one shard a push ahead of another.
    """
    first = sources[0].meta
    for s in sources[1:]:
        for key in ("table", "dim", "dtype", "optimizer", "n_shards"):
            if s.meta[key] != first[key]:
                raise ValueError(
                    f"shard directories disagree on {key}: {sources[0].directory} has "
                    f"{first[key]!r}, {s.directory} has {s.meta[key]!r}; "
                    f"they are not one save of one table"
                )
        if saved_routing(s.meta) != saved_routing(first):
            raise ValueError(
                f"shard directories disagree on routing: {sources[0].directory} has version "
                f"{saved_routing(first)}, {s.directory} has {saved_routing(s.meta)}; "
                f"they are not one save of one table"
            )
    seen: Dict[int, str] = {}
    for s in sources:
        k = s.meta["shard"]
        if k in seen:
            raise ValueError(f"{seen[k]} and {s.directory} are both shard {k} of table {first['table']!r}")
        seen[k] = s.directory
    steps = sorted({s.meta["step"] for s in sources})
    if len(steps) > 1:
        log.info(
            "table %s: saved shards are at steps %s (an async save); taking %d",
            first["table"],
            steps,
            steps[-1],
        )
    return first["n_shards"], steps[-1]


def open_shards(
    spec: TableSpec, directories: Sequence[str], shard: int, n_shards: int
) -> Tuple[List[Source], int]:
    """Validate the saved shard directories a new shard ``shard`` of ``n_shards`` loads from.

    Returns the sources that can hold its ids and the saved step. Refuses
    (ValueError) directories of another table, dim, dtype or optimizer, a set
    that disagrees on step or shard count, and a set missing a shard that may
    hold our ids: with the same shard count and routing only our own shard, otherwise all (a set
    placed by another routing version is re-routed as a change of count is).
    """
    if isinstance(directories, (str, os.PathLike)):
        directories = [directories]
    if not directories:
        raise ValueError(f"table {spec.name!r}: no shard directories to load from")
    sources = [read_source(os.fspath(d)) for d in directories]
    for s in sources:
        m = s.meta
        for key, want in (
            ("table", spec.name),
            ("dim", spec.dim),
            ("dtype", spec.dtype),
            ("optimizer", spec.optimizer.name),
        ):
            if m[key] != want:
                raise ValueError(
                    f"{s.directory}: saved table has {key} {m[key]!r}, but table "
                    f"{spec.name!r} being loaded has {key} {want!r}"
                )
        missing = sorted(set(["ids", "rows", *STATE_NAMES[spec.optimizer.name]]) - set(s.arrays))
        if missing:
            raise ValueError(
                f"{s.directory}: {META} lists no arrays {missing} for optimizer {spec.optimizer.name!r}"
            )
        saved = m.get("spec", {})
        was = (saved.get("init"), saved.get("seed"), saved.get("init_version", 1))  # no version: the first
        if was != (now := (spec.init, spec.seed, spec.init_version)):
            msg = "table %s: %s was saved with init, seed, init_version %s, now %s; rows never updated differ"
            log.warning(msg, spec.name, s.directory, was, now)
    old_n, step = check_set(sources)
    present = {s.meta["shard"] for s in sources}
    if old_n == n_shards and saved_routing(sources[0].meta) == ROUTING_VERSION:
        if shard not in present:
            raise ValueError(
                f"table {spec.name!r}: loading shard {shard} of {n_shards} needs the saved "
                f"shard {shard}, got shards {sorted(present)}"
            )
        sources = [s for s in sources if s.meta["shard"] == shard]
        step = sources[0].meta["step"]
    else:
        missing = sorted(set(range(old_n)) - present)
        if missing:
            raise ValueError(
                f"table {spec.name!r}: re-sharding {old_n} -> {n_shards} shards (routing "
                f"{saved_routing(sources[0].meta)} -> {ROUTING_VERSION}) needs every saved shard; "
                f"missing {missing}"
            )
    return sources, step


def iter_selected(
    src: Source, names: Sequence[str], shard: int, n_shards: int, chunk: int
) -> Iterator[Tuple[np.ndarray, List[np.ndarray]]]:
    """Yield (ids, [arrays named ``names``]) of ``src``'s rows that belong to ``shard`` of ``n_shards``.

    Reads ``chunk`` rows at a time from the memory maps, so memory stays
    bounded by the chunk plus what is kept. Rows kept whole are yielded as
    views of the maps: the caller copies them once, where they are stored.
    """
    ids_all = src.arrays["ids"]
    for a in range(0, src.rows, chunk):
        b = min(src.rows, a + chunk)
        ids = np.array(ids_all[a:b])
        keep = shard_of(ids, n_shards) == shard if n_shards > 1 else None
        if keep is None or keep.all():
            yield ids, [src.arrays[name][a:b] for name in names]
        else:
            sel = np.flatnonzero(keep)
            yield ids[sel], [src.arrays[name][a:b][sel] for name in names]
