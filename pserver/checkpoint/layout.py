"""Checkpoints of a pserver: its blocks with their optimizer state, its table shards, and
the trainers' progress (last step and data position), written so a crash never costs
the previous checkpoint.

Layout under ``checkpoint_dir`` (shared by every pserver of the job)::

    step-000000000120/
        pserver-0-of-2/                 this pserver's part; written as pserver-0-of-2.tmp-PID, renamed
            blocks.pt                   {block: {param, row_start, row_end, value, state}}
            tables/<table>/shard-0-of-2/  (pserver.tables.files files)
        pserver-0-of-2.json             the manifest, written last: the part exists iff this does
        pserver-1-of-2/ ...
    closed-pserver-0-of-2.json          the trainers that have closed, rewritten at every close

A checkpoint at step *v* is complete once the manifests of all N pservers that
wrote it exist. Sync pservers checkpoint at the same step boundaries, so a
complete checkpoint is one consistent model. Blocks are saved with their
parameter rows, so a checkpoint loads into any number of pservers (re-sharding):
each new block is cut from the saved rows of its parameter, optimizer state
included, and each table shard selects its ids from every saved shard.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from transpiler.placement import by_param, cut_block

from .. import atomic_files
from ..tables import files as table_files
from ..tables.plain_files import export_table

log = logging.getLogger(__name__)

FORMAT = "torch-pserver-checkpoint"
FORMAT_VERSION = 1
BLOCKS_FILE = "blocks.pt"
TABLES_DIR = "tables"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_MANIFEST = re.compile(r"^pserver-(\d+)-of-(\d+)\.json$")


def step_directory(root: str, step: int) -> str:
    """The directory of the checkpoint at ``step`` under ``root``."""
    return os.path.join(root, f"step-{step:012d}")


def part_name(shard: int, n_shards: int) -> str:
    """The name of pserver ``shard``'s part (and, with ``.json``, its manifest) in a step directory."""
    return f"pserver-{shard}-of-{n_shards}"


@dataclass
class Saved:
    """One loadable checkpoint: the part directories and manifests of every old pserver.

    In sync mode all parts share ``step``; in async mode each pserver's part is
    its own latest, and ``step`` is that of this pserver's part.
    """

    step: int
    parts: List[str]
    manifests: List[dict]

    @property
    def n_shards(self) -> int:
        return len(self.parts)


def _read_manifest(path: str) -> Optional[dict]:
    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read())
    except FileNotFoundError:  # pruned by its pserver since the directory was listed
        return None
    except (OSError, ValueError) as e:
        log.warning("ignoring unreadable checkpoint manifest %s: %s", path, e)
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        log.warning("ignoring %s: not a %s manifest", path, FORMAT)
        return None
    return manifest


def list_parts(root: str) -> Dict[Tuple[int, int], Dict[int, Tuple[str, dict]]]:
    """Every written part under ``root``: ``{(step, n_shards): {shard: (part directory, manifest)}}``."""
    found: Dict[Tuple[int, int], Dict[int, Tuple[str, dict]]] = {}
    if not os.path.isdir(root):
        return found
    for entry in os.listdir(root):
        m = _STEP_DIR.match(entry)
        if not m:
            continue
        step_dir = os.path.join(root, entry)
        try:
            names = os.listdir(step_dir)
        except FileNotFoundError:  # another pserver pruned the last part of it meanwhile
            continue
        for name in names:
            mm = _MANIFEST.match(name)
            if not mm:
                continue
            manifest = _read_manifest(os.path.join(step_dir, name))
            if manifest is None:
                continue
            shard, n = int(mm.group(1)), int(mm.group(2))
            part = os.path.join(step_dir, name[: -len(".json")])
            found.setdefault((int(m.group(1)), n), {})[shard] = (part, manifest)
    return found


def find_saved(
    root: str, sync_mode: bool, step: Optional[int] = None, shard: Optional[int] = None
) -> Optional[Saved]:
    """The checkpoint to load from ``root``: the latest complete one (or the one at ``step``).

    Sync: the latest step at which every pserver of the writing job left a
    manifest. Async: every old pserver's own latest part, from the job that
    wrote the newest manifest (``step`` is then ``shard``'s part's step, or the
    newest). None when there is nothing complete to load.
    """
    parts = list_parts(root)
    if sync_mode or step is not None:
        for s, n in sorted(parts, reverse=True):
            if step is not None and s != step:
                continue
            have = parts[(s, n)]
            if sorted(have) == list(range(n)):
                return Saved(s, [have[k][0] for k in range(n)], [have[k][1] for k in range(n)])
        return None
    if not parts:
        return None
    n = max((m["written_at"], nn) for (_, nn), have in parts.items() for _, m in have.values())[1]
    latest: Dict[int, Tuple[int, str, dict]] = {}
    for (s, nn), have in parts.items():
        if nn != n:
            continue
        for k, (part, manifest) in have.items():
            if k not in latest or s > latest[k][0]:
                latest[k] = (s, part, manifest)
    if sorted(latest) != list(range(n)):
        log.warning(
            "%s: async checkpoints of %d pservers lack parts %s", root, n, sorted(set(range(n)) - set(latest))
        )
        return None
    own = latest[shard][0] if shard is not None and shard in latest else max(s for s, _, _ in latest.values())
    return Saved(own, [latest[k][1] for k in range(n)], [latest[k][2] for k in range(n)])


# -- writing ---------------------------------------------------------------------


def write_part(root: str, step: int, shard: int, n_shards: int, store, tables, manifest: dict) -> str:
    """Write pserver ``shard``'s part of the checkpoint at ``step``; returns the part directory.

    Order makes a crash at any point harmless: everything goes to a temporary
    directory first (each file fsynced), which is renamed into place; the
    manifest is written (atomically) last. A part left over from an abandoned
    run at the same step loses its manifest before it is replaced.
    """
    step_dir = step_directory(root, step)
    os.makedirs(step_dir, exist_ok=True)
    name = part_name(shard, n_shards)
    part, manifest_path = os.path.join(step_dir, name), os.path.join(step_dir, name + ".json")
    tmp = f"{part}.tmp-{os.getpid()}"
    for stale in glob.glob(glob.escape(part) + ".tmp-*"):  # left by a crash of an earlier process
        shutil.rmtree(stale, ignore_errors=True)
    os.makedirs(tmp)
    payload = store.saved_blocks()
    atomic_files.atomic_write(os.path.join(tmp, BLOCKS_FILE), lambda f: torch.save(payload, f))
    tables.save(os.path.join(tmp, TABLES_DIR))
    atomic_files.fsync_dir(tmp)
    if os.path.exists(manifest_path):
        os.unlink(manifest_path)
        atomic_files.fsync_dir(step_dir)
    if os.path.exists(part):
        shutil.rmtree(part)
    os.rename(tmp, part)
    atomic_files.fsync_dir(step_dir)
    _write_manifest(
        manifest_path,
        {
            **manifest,
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "step": int(step),
            "shard": shard,
            "n_shards": n_shards,
            "written_at": time.time(),
            "blocks": sorted(payload),
            "tables": sorted(tables.names()),
        },
    )
    atomic_files.fsync_dir(step_dir)
    return part


def _closed_path(root: str, shard: int, n_shards: int) -> str:
    return os.path.join(root, f"closed-{part_name(shard, n_shards)}.json")


def write_closed(root: str, shard: int, n_shards: int, closed) -> None:
    """Record, atomically, that the trainers ``closed`` have closed (as pserver ``shard`` saw it).

    Apart from the checkpoints, and at once: a pserver restarted from a
    checkpoint older than a trainer's close must not wait for that trainer.
    """
    os.makedirs(root, exist_ok=True)
    atomic_files.write_json(_closed_path(root, shard, n_shards), {"closed": sorted(closed)})


def read_closed(root: str, shard: int, n_shards: int) -> set:
    """The trainers :func:`write_closed` last recorded for pserver ``shard`` (none if nothing readable)."""
    path = _closed_path(root, shard, n_shards)
    try:
        with open(path, "rb") as f:
            return {int(t) for t in json.loads(f.read())["closed"]}
    except FileNotFoundError:
        return set()
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring unreadable record of closed trainers %s: %s", path, e)
        return set()


def _write_manifest(path: str, manifest: dict) -> None:
    # Its own function: the crash tests kill the process exactly here.
    atomic_files.write_json(path, manifest)


def remove_part(part: str) -> None:
    """Delete one part: its manifest first (so it stops counting), then its files."""
    try:
        os.unlink(part + ".json")
    except FileNotFoundError:
        pass
    shutil.rmtree(part, ignore_errors=True)
    step_dir = os.path.dirname(part)
    try:
        os.rmdir(step_dir)  # only once every pserver's part is gone
    except OSError:
        pass


def prune(root: str, shard: int, n_shards: int, keep: int, newer_than: Optional[int] = None) -> None:
    """Delete this pserver's parts beyond the ``keep`` newest, and (``newer_than``) those after a step.

    Parts after ``newer_than`` belong to a timeline abandoned by a roll-back.
    """
    mine = sorted(
        (s, have[shard][0]) for (s, n), have in list_parts(root).items() if n == n_shards and shard in have
    )
    if newer_than is not None:
        for s, part in mine:
            if s > newer_than:
                remove_part(part)
        mine = [(s, p) for s, p in mine if s <= newer_than]
    for _, part in mine[:-keep]:
        remove_part(part)


# -- reading ---------------------------------------------------------------------


def load_blocks(parts: Sequence[str]) -> Dict[str, List[dict]]:
    """The saved blocks of every part, grouped by parameter and ordered by first row."""
    saved = []
    for part in parts:
        path = os.path.join(part, BLOCKS_FILE)
        try:
            saved.append(torch.load(path, map_location="cpu", weights_only=True))
        except (OSError, RuntimeError, EOFError) as e:
            raise ValueError(f"checkpoint part {part}: cannot read {BLOCKS_FILE}: {e}") from None
    return by_param(saved)


def table_directories(saved: Saved, table: str) -> List[str]:
    """The saved shard directories of ``table`` across every part of ``saved``."""
    return [
        d for part in saved.parts for d in table_files.saved_shards(os.path.join(part, TABLES_DIR), table)
    ]


# -- export ----------------------------------------------------------------------


def dense_state_dict(saved: Saved) -> Dict[str, torch.Tensor]:
    """The full dense parameters of a checkpoint, as a plain ``state_dict`` (no tables, no buffers)."""
    out = {}
    for param, entries in load_blocks(saved.parts).items():
        first = entries[0]["value"]
        if first.dim() == 0:
            out[param] = first.clone()
            continue
        rows = entries[-1]["row_end"]
        value, _ = cut_block({param: entries}, param, 0, rows, [rows, *first.shape[1:]])
        out[param] = value.clone()
    return out


def export(root: str, out_dir: str, step: Optional[int] = None, sync_mode: bool = True) -> dict:
    """Export a checkpoint for serving: ``out_dir/state_dict.pt`` (dense) and ``out_dir/tables/``.

    The dense parameters load into the original module with
    ``load_state_dict(..., strict=False)`` (tables and buffers are not in
    them); each table becomes ``<table>.ids.npy`` / ``.rows.npy`` / ``.json``
    (see :func:`pserver.tables.plain_files.export_table`). Returns a summary.
    """
    saved = find_saved(root, sync_mode, step)
    if saved is None:
        raise ValueError(f"{root}: no complete checkpoint{'' if step is None else f' at step {step}'}")
    os.makedirs(out_dir, exist_ok=True)
    state = dense_state_dict(saved)
    state_path = os.path.join(out_dir, "state_dict.pt")
    atomic_files.atomic_write(state_path, lambda f: torch.save(state, f))
    tables = {}
    for name in saved.manifests[0].get("tables", []):
        tables[name] = export_table(table_directories(saved, name), os.path.join(out_dir, TABLES_DIR))
    return {
        "step": saved.step,
        "pservers": saved.n_shards,
        "state_dict": state_path,
        "params": {k: list(v.shape) for k, v in state.items()},
        "tables": tables,
    }
