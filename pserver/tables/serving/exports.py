"""Serving exports of distributed tables: a full base, then deltas, written shard by shard.

A serving process needs the tables without a cluster, and cheaply kept up to
date, so a job writes a **base** (every row) now and then and a **delta**
(only the rows changed since the previous export, plus tombstones for ids
deleted since then) at other steps. Each of the N pservers writes its own
shard K of every table, independently and at the same step::

    ROOT/<step:012d>-<kind>/                 one export; kind "base" or "delta"
        <table>/shard-K-of-N/ids.npy         int64 (m,): ids of the rows written
        <table>/shard-K-of-N/rows.npy        float32|float64 (m, dim): their rows
        <table>/shard-K-of-N/tombstones.npy  int64 (t,): ids deleted since the previous
                                             export (empty in a base), never also in ids
        <table>/shard-K-of-N/meta.json       format, version, table, dim, dtype, kind, step,
                                             previous (the export a delta follows; None for
                                             a base), shard, n_shards, routing (the
                                             version of transpiler.layout.routing), rows, tombstones
        DONE.shard-K-of-N                    pserver K wrote every table of this export
        DONE                                 every pserver did: the export is complete

Every file goes to a temporary name, is fsynced and renamed, and directories
are fsynced after renames and mkdirs, so the names survive a crash too. A
shard's ``meta.json`` is written after its arrays, ``DONE.shard-K-of-N`` after
all of pserver K's shards and ``DONE`` only once every ``DONE.shard`` exists:
a SIGKILL at any moment leaves an export without ``DONE`` (readers skip it)
or a complete one. ``DONE`` is created with ``O_CREAT|O_EXCL`` so that of two
pservers finishing at once exactly one creates it; since each writes its own
``DONE.shard`` durably *before* looking for the others', the later of them
always sees all N. (That last argument needs a file system on which a rename
is seen by other hosts at once: a local or POSIX-consistent shared one.)

Deltas chain by name (``previous``) rather than by step arithmetic, so a
reader never applies a delta on top of a state it does not follow from. At
most one export per step exists (a base and a delta of one step would make
the chain ambiguous). A delta writes every table, unchanged ones with empty
arrays, so each table's shards carry the link. The reader, numpy only, is
:mod:`pserver.tables.serving.reader`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from typing import List, Optional, Tuple

import numpy as np

from transpiler.layout.routing import ROUTING_VERSION

from ... import atomic_files

__all__ = [
    "FORMAT",
    "VERSION",
    "KINDS",
    "export_name",
    "parse_export_name",
    "write_export_shard",
    "finish_export_shard",
    "prune_exports",
    "is_complete",
]

log = logging.getLogger(__name__)

FORMAT = "torch-pserver-export"
VERSION = 1
KINDS = ("base", "delta")
DTYPES = ("float32", "float64")
DONE = "DONE"
META = "meta.json"
_NAME = re.compile(r"^(\d{12})-(base|delta)$")
_DONE_SHARD = re.compile(r"^DONE\.shard-(\d+)-of-(\d+)$")
SHARD_DIR = re.compile(r"^shard-(\d+)-of-(\d+)$")  # a table's shard directory in an export


def export_name(step: int, kind: str) -> str:
    """The directory name of the export of ``kind`` ("base" or "delta") at training step ``step``;
    zero-padded so that names sort in step order."""
    if kind not in KINDS:
        raise ValueError(f"export kind {kind!r} is not one of {KINDS}")
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not 0 <= step < 10**12:
        raise ValueError(f"export step {step!r} is not an integer in [0, 1e12)")
    return f"{int(step):012d}-{kind}"


def parse_export_name(name: str) -> Optional[Tuple[int, str]]:
    """``(step, kind)`` of an export directory name, or None for any other name."""
    m = _NAME.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def is_complete(root: str, name: str) -> bool:
    """Whether export ``name`` under ``root`` has its done-file (every pserver finished it)."""
    return os.path.exists(os.path.join(root, name, DONE))


def _makedirs_durable(path: str) -> None:
    """``os.makedirs`` that fsyncs the parent of every directory it creates, so a crash cannot
    lose a directory that files already renamed into it are reachable through."""
    path = os.path.abspath(path)
    if os.path.isdir(path):
        return
    _makedirs_durable(os.path.dirname(path))
    try:
        os.mkdir(path)
    except FileExistsError:
        return  # another pserver made it first; it fsyncs the parent itself
    atomic_files.fsync_dir(os.path.dirname(path))


def _check_shard(shard: int, n_shards: int) -> None:
    if not (isinstance(n_shards, (int, np.integer)) and n_shards >= 1):
        raise ValueError(f"n_shards {n_shards!r} is not a positive integer")
    if not (isinstance(shard, (int, np.integer)) and 0 <= shard < n_shards):
        raise ValueError(f"shard {shard!r} is not in [0, {n_shards})")


def _check_arrays(table: str, ids, rows, tombstones) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validated ``ids``, ``rows``, ``tombstones`` (None: empty) of one table shard."""
    where = f"table {table!r}"
    if not isinstance(ids, np.ndarray) or ids.dtype != np.int64 or ids.ndim != 1:
        raise ValueError(
            f"{where}: ids must be a 1-D int64 array, got "
            f"{getattr(ids, 'dtype', type(ids).__name__)} {list(np.shape(ids))}"
        )
    if not isinstance(rows, np.ndarray) or rows.ndim != 2 or rows.shape[0] != ids.size:
        raise ValueError(
            f"{where}: rows must be an (m, dim) array with m = {ids.size} ids, got "
            f"shape {list(np.shape(rows))}"
        )
    if rows.dtype.name not in DTYPES:
        raise ValueError(f"{where}: rows dtype {rows.dtype} is not one of {DTYPES}")
    if rows.shape[1] < 1:
        raise ValueError(f"{where}: rows have dim {rows.shape[1]}")
    if tombstones is None:
        tombstones = np.empty(0, np.int64)
    if not isinstance(tombstones, np.ndarray) or tombstones.dtype != np.int64 or tombstones.ndim != 1:
        raise ValueError(
            f"{where}: tombstones must be a 1-D int64 array, got "
            f"{getattr(tombstones, 'dtype', type(tombstones).__name__)} "
            f"{list(np.shape(tombstones))}"
        )
    for label, a in (("ids", ids), ("tombstones", tombstones)):
        if np.unique(a).size != a.size:
            raise ValueError(f"{where}: {label} hold duplicates (a reader could not tell which wins)")
    both = np.intersect1d(ids, tombstones)
    if both.size:
        raise ValueError(
            f"{where}: ids {both[:8].tolist()} are both written and tombstoned; an id "
            f"deleted and re-added since the previous export is written as a row only"
        )
    return ids, rows, tombstones


def _full_meta(
    name: str, table: str, shard: int, n_shards: int, rows: np.ndarray, tombstones: np.ndarray, meta: dict
) -> dict:
    """``meta`` checked against ``name`` and completed with the fields the arrays determine."""
    missing = [k for k in ("kind", "step", "previous") if k not in meta]
    if missing:
        raise ValueError(f"table {table!r}: meta lacks {missing} (kind, step and previous are required)")
    kind, step, previous = meta["kind"], meta["step"], meta["previous"]
    if export_name(step, kind) != name:
        raise ValueError(
            f"export {name!r} does not match meta kind {kind!r}, step {step!r} "
            f"(its name would be {export_name(step, kind)!r})"
        )
    if kind == "base":
        if previous is not None:
            raise ValueError(f"base {name}: previous must be None, got {previous!r}")
        if tombstones.size:
            raise ValueError(
                f"base {name}: table {table!r} has {tombstones.size} tombstones; a base "
                f"holds every live row and no tombstones"
            )
    else:
        parsed = parse_export_name(previous) if isinstance(previous, str) else None
        if parsed is None:
            raise ValueError(f"delta {name}: previous must name the export it follows, got {previous!r}")
        if parsed[0] >= step:
            raise ValueError(f"delta {name}: previous {previous!r} is not older than it")
    full = dict(
        meta,
        format=FORMAT,
        version=VERSION,
        table=table,
        dim=int(rows.shape[1]),
        dtype=rows.dtype.name,
        step=int(step),
        shard=int(shard),
        n_shards=int(n_shards),
        routing=ROUTING_VERSION,
        rows=int(rows.shape[0]),
        tombstones=int(tombstones.size),
    )
    for key in ("format", "version", "table", "dim", "dtype", "shard", "n_shards", "rows", "tombstones"):
        if key in meta and meta[key] != full[key]:
            raise ValueError(
                f"table {table!r}: meta says {key} {meta[key]!r}, the arrays and arguments say {full[key]!r}"
            )
    return full


def write_export_shard(
    root: str,
    name: str,
    table: str,
    shard: int,
    n_shards: int,
    ids: np.ndarray,
    rows: np.ndarray,
    tombstones: np.ndarray,
    meta: dict,
) -> str:
    """Write shard ``shard`` of ``n_shards`` of ``table`` into export ``name`` under ``root``, durably.

    ``meta`` needs ``kind``, ``step`` and ``previous`` (any further keys are
    kept); the rest of ``meta.json`` comes from the arrays. Raises ValueError
    for ids that are not 1-D int64 or hold duplicates, rows that are not
    (len(ids), dim) float32/float64, tombstones that meet ids, a base with
    tombstones or a previous, a delta without a valid older previous, a name
    other than ``export_name(step, kind)``, another export at the same step,
    and an export this pserver (or every pserver) has already finished.
    Rewriting an unfinished shard (a pserver restarted mid-export) is allowed.
    Returns the shard directory.
    """
    _check_shard(shard, n_shards)
    if (
        not isinstance(table, str)
        or not table
        or table in (".", "..")
        or "/" in table
        or os.sep in table
        or table.startswith(("DONE", "."))
    ):
        raise ValueError(f"table name {table!r} cannot be a directory of an export")
    ids, rows, tombstones = _check_arrays(table, ids, rows, tombstones)
    full = _full_meta(name, table, shard, n_shards, rows, tombstones, meta)
    step, kind = parse_export_name(name)
    twin = os.path.join(root, export_name(step, "delta" if kind == "base" else "base"))
    if os.path.exists(twin):
        raise ValueError(f"{twin} exists: one step has at most one export")
    export_dir = os.path.join(root, name)
    done_shard = os.path.join(export_dir, f"DONE.shard-{shard}-of-{n_shards}")
    if os.path.exists(os.path.join(export_dir, DONE)) or os.path.exists(done_shard):
        raise ValueError(
            f"export {export_dir}: pserver {shard} has already finished it; a finished "
            f"export is never rewritten (readers may be using it)"
        )
    directory = os.path.join(export_dir, table, f"shard-{shard}-of-{n_shards}")
    _makedirs_durable(directory)
    meta_path = os.path.join(directory, META)
    if os.path.exists(meta_path):
        # Without its meta the directory reads as unwritten while the arrays are replaced.
        os.unlink(meta_path)
        atomic_files.fsync_dir(directory)
    for label, array in (("ids", ids), ("rows", rows), ("tombstones", tombstones)):
        atomic_files.atomic_write(
            os.path.join(directory, f"{label}.npy"), lambda f, a=array: np.save(f, a, allow_pickle=False)
        )
    atomic_files.fsync_dir(directory)
    atomic_files.write_json(meta_path, full)
    atomic_files.fsync_dir(directory)
    log.debug(
        "export %s: table %s shard %d/%d written (%d rows, %d tombstones)",
        name,
        table,
        shard,
        n_shards,
        full["rows"],
        full["tombstones"],
    )
    return directory


def _done_shards(export_dir: str) -> List[Tuple[int, int]]:
    """``(shard, n_shards)`` of every ``DONE.shard-K-of-N`` file in ``export_dir``."""
    found = []
    for entry in os.listdir(export_dir):
        m = _DONE_SHARD.match(entry)
        if m:
            found.append((int(m.group(1)), int(m.group(2))))
    return found


def finish_export_shard(root: str, name: str, shard: int, n_shards: int) -> bool:
    """Mark pserver ``shard``'s part of export ``name`` done; complete the export if every pserver has.

    Call it after every table's shard of this pserver is written (it checks
    that each table directory has this shard's ``meta.json``). It writes
    ``DONE.shard-K-of-N`` durably, then creates ``DONE`` with ``O_EXCL`` if all
    N ``DONE.shard`` files exist; of pservers finishing together one creates
    it and the others' FileExistsError is ignored. Returns True when the
    export is complete. Raises ValueError when another pserver finished it
    with a different shard count, or a table lacks this pserver's shard.
    """
    _check_shard(shard, n_shards)
    if parse_export_name(name) is None:
        raise ValueError(f"{name!r} is not an export name (see export_name)")
    export_dir = os.path.join(root, name)
    if not os.path.isdir(export_dir):
        raise ValueError(f"export {export_dir} does not exist: pserver {shard} wrote no table of it")
    done_path = os.path.join(export_dir, DONE)
    others = sorted({n for _, n in _done_shards(export_dir)} - {n_shards})
    if others:
        raise ValueError(
            f"export {export_dir}: other pservers finished it as shards of {others}, "
            f"this one as a shard of {n_shards}; one export has one shard count"
        )
    tables = sorted(e for e in os.listdir(export_dir) if os.path.isdir(os.path.join(export_dir, e)))
    if not tables:
        raise ValueError(f"export {export_dir} has no tables; write them before finishing it")
    lacking = [
        t
        for t in tables
        if not os.path.isfile(os.path.join(export_dir, t, f"shard-{shard}-of-{n_shards}", META))
    ]
    if lacking:
        raise ValueError(
            f"export {export_dir}: pserver {shard} of {n_shards} has not written "
            f"tables {lacking}; finish after every table's shard is written"
        )
    atomic_files.write_json(
        os.path.join(export_dir, f"DONE.shard-{shard}-of-{n_shards}"),
        {"shard": int(shard), "n_shards": int(n_shards), "tables": tables},
    )
    atomic_files.fsync_dir(export_dir)
    finished = {k for k, n in _done_shards(export_dir) if n == n_shards}
    if finished != set(range(n_shards)):
        log.info(
            "export %s: pserver %d of %d done; waiting for %s",
            name,
            shard,
            n_shards,
            sorted(set(range(n_shards)) - finished),
        )
        return False
    try:
        fd = os.open(done_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return True  # another pserver saw all N first and completed it
    try:
        # Readers only test that DONE exists; its text is for people.
        os.write(fd, json.dumps({"n_shards": int(n_shards), "completed_by": int(shard)}).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    atomic_files.fsync_dir(export_dir)
    log.info("export %s complete (%d pservers, tables %s)", name, n_shards, tables)
    return True


def prune_exports(root: str, keep_bases: int) -> List[str]:
    """Remove exports no reader needs any more; return their names, oldest first.

    Keeps the ``keep_bases`` newest complete bases and every export after the
    oldest of them; removes the complete exports older than it (older bases
    and the deltas that follow them) and every incomplete export older than
    the newest complete one (an abandoned, crashed export: pservers export in
    step order). Incomplete exports newer than that may be in progress and
    are kept. ``DONE`` goes first, so a prune that is itself interrupted
    leaves an incomplete export that the next prune removes.
    """
    if not isinstance(keep_bases, int) or keep_bases < 1:
        raise ValueError(f"keep_bases {keep_bases!r} must be >= 1 (a reader needs a base)")
    if not os.path.isdir(root):
        return []
    exports = sorted(
        (parsed[0], entry)
        for entry in os.listdir(root)
        if (parsed := parse_export_name(entry)) and os.path.isdir(os.path.join(root, entry))
    )
    complete = [(step, n) for step, n in exports if is_complete(root, n)]
    if not complete:
        return []
    bases = [step for step, n in complete if n.endswith("-base")]
    cutoff = bases[-keep_bases] if len(bases) >= keep_bases else -1
    newest = complete[-1][0]
    removed = []
    for step, n in exports:
        done = is_complete(root, n)
        if (done and step < cutoff) or (not done and step < newest):
            path = os.path.join(root, n)
            if done:
                os.unlink(os.path.join(path, DONE))
                atomic_files.fsync_dir(path)
            shutil.rmtree(path)
            removed.append(n)
    if removed:
        atomic_files.fsync_dir(root)
        log.info("pruned exports %s under %s (keeping %d complete bases)", removed, root, keep_bases)
    return removed
