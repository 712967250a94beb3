"""A saved table as plain files: every shard of one save merged into one file set readable with numpy alone.

``python -m pserver.tables.cli ROOT OUT`` (:mod:`.cli`) and a checkpoint's export for serving
(:func:`pserver.checkpoint.layout.export`) write them from the shard files :mod:`.files` reads.
"""

from __future__ import annotations

import logging
import os
from typing import Dict, Sequence

import numpy as np

from .. import atomic_files
from .files import check_set, read_source, saved_shards

__all__ = ["export_table", "export_tables"]

# Under the shard files' name: these were its records, and operators filter its log by that name.
log = logging.getLogger("pserver.tables.files")

_COPY_ROWS = 1 << 22  # rows copied at once


def export_table(directories: Sequence[str], out_dir: str) -> dict:
    """Merge every saved shard of one table into one file set usable without the cluster.

    Writes ``out_dir/<table>.ids.npy`` (int64 (n,)), ``out_dir/<table>.rows.npy``
    ((n, dim), rows in the order of the ids, not sorted) and ``out_dir/<table>.json``
    (name, dim, dtype, rows, init, init_kwargs, seed, padding_idx, init_version: 1 if none was saved;
    so that ids
    not in the file are reproduced by ``transpiler.tables.initial_rows``; also
    the optimizer, step and full spec). The directories must be one complete
    save (every shard once, from any shard count). Copies chunk by chunk through
    memory maps. Returns the json as a dict.
    """
    if isinstance(directories, (str, os.PathLike)):
        directories = [directories]
    if not directories:
        raise ValueError("export_table: no shard directories given")
    sources = [read_source(os.fspath(d)) for d in directories]
    n_shards, step = check_set(sources)
    missing = sorted(set(range(n_shards)) - {s.meta["shard"] for s in sources})
    if missing:
        raise ValueError(
            f"export_table: table {sources[0].meta['table']!r} was saved as {n_shards} "
            f"shards; missing shards {missing}"
        )
    sources.sort(key=lambda s: s.meta["shard"])
    meta = sources[0].meta
    name, dim, dtype = meta["table"], meta["dim"], np.dtype(meta["dtype"])
    total = sum(s.rows for s in sources)
    os.makedirs(out_dir, exist_ok=True)
    for part, shape, dt in (("ids", (total,), np.dtype(np.int64)), ("rows", (total, dim), dtype)):
        with atomic_files.replacing(os.path.join(out_dir, f"{name}.{part}.npy")) as tmp:
            out = np.lib.format.open_memmap(tmp, mode="w+", dtype=dt, shape=shape)
            at = 0
            for s in sources:
                src = s.arrays[part]
                for a in range(0, s.rows, _COPY_ROWS):
                    b = min(s.rows, a + _COPY_ROWS)
                    out[at + a : at + b] = src[a:b]
                at += s.rows
            out.flush()
            del out
    spec = meta.get("spec", {})
    info = {
        "name": name,
        "dim": dim,
        "dtype": meta["dtype"],
        "rows": total,
        "init": spec.get("init"),
        "init_kwargs": spec.get("init_kwargs"),
        "seed": spec.get("seed"),
        "padding_idx": spec.get("padding_idx"),
        "init_version": spec.get("init_version", 1),
        "optimizer": meta["optimizer"],
        "step": step,
        "saved_shards": n_shards,
        "ids_file": f"{name}.ids.npy",
        "rows_file": f"{name}.rows.npy",
        "spec": spec,
    }
    atomic_files.write_json(os.path.join(out_dir, f"{name}.json"), info)
    log.info("table %s: exported %d rows of %d shards to %s", name, total, n_shards, out_dir)
    return info


def export_tables(root: str, out_dir: str) -> Dict[str, dict]:
    """:func:`export_table` for every table saved under ``root``; ``{table: its json}``."""
    tables = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    if not tables:
        raise ValueError(f"no saved tables under {root!r}")
    return {t: export_table(saved_shards(root, t), out_dir) for t in tables}
