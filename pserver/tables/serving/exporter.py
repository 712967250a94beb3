"""TableExporter: a pserver's scheduled base and delta exports of its table shards, for serving.

Every ``export_every`` updates (the engine's update count: the step in sync
mode), each pserver exports its shard of every table into
``export_dir/<step>-<kind>`` (format: :mod:`pserver.tables.serving.exports`). The
kind and the export a delta follows are functions of the step alone, so every
pserver names the same export without talking to the others: export ``i =
step // export_every`` is a base when ``i % export_base_every == 0`` and
otherwise a delta following export ``i - 1``.

With ``export_every_seconds`` instead (sync mode), pserver 0 watches the
clock and announces each export's step, kind and predecessor in
``export_dir/NEXT`` two steps ahead (:class:`ClockSchedule`).

A delta holds the rows updated since this pserver's previous export (their
``seen_step`` is later) and the ids evicted since then that hold no row now.
A pserver that has not exported since it started or was rolled back does not
know what its previous export held, so its first delta is a *resync*: every
row it holds, and tombstones for the ids the export chain on disk holds that
are its shard's but it does not hold. The chain is read across all its shards,
so a job restarted at another pserver count (or routing version) tombstones
each id once, on its current owner. Either way a reader applying the chain
ends with exactly the live table.

The rows are copied under each shard's lock when the step ends (a delta is
small; a base copies the shard once) and written on a background thread, so
training goes on meanwhile. The next export waits for the previous write: an
export is never skipped, since the next delta names it. A failed write (a
full disk) is logged and leaves that export incomplete; readers stay at the
previous complete export until the next base.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import time
from typing import Callable, Dict, Optional, Tuple

import numpy as np

from transpiler.tables import shard_of

from ... import atomic_files
from . import exports

log = logging.getLogger(__name__)


def export_plan(step: int, every: int, base_every: int) -> Optional[Tuple[str, str, Optional[str]]]:
    """(name, kind, previous name) of the export due at ``step``, or None when none is.

    Export ``i = step // every`` (step a multiple of ``every``, above 0) is a
    base when ``i % base_every == 0`` or it is the first; otherwise a delta
    following export ``i - 1``.
    """
    if every <= 0 or step <= 0 or step % every:
        return None
    i = step // every
    if i == 1 or i % base_every == 0:
        return exports.export_name(step, "base"), "base", None
    before = step - every
    kind_before = "base" if (i - 1 == 1 or (i - 1) % base_every == 0) else "delta"
    return exports.export_name(step, "delta"), "delta", exports.export_name(before, kind_before)


class ClockSchedule:
    """``export_every_seconds`` (sync mode): pserver 0 reads the clock and announces the export's step.

    When ``seconds`` have passed since its last announcement, pserver 0 picks
    the step two after the one it just applied and writes it, with the kind
    and the export it follows, to ``export_dir/NEXT`` (atomically); every
    pserver reads that file at its step ends and exports at that step. Two
    steps suffice: in sync mode no pserver can apply step s + 1 before
    pserver 0 has answered step s, which it does after writing the file.
    """

    NEXT = "NEXT"

    def __init__(
        self, root: str, seconds: float, base_every: int, shard: int, clock: Callable[[], float] = time.time
    ):
        self.root, self.seconds, self.base_every, self.shard = root, seconds, base_every, shard
        self.clock = clock
        self._since = clock()
        self._count = 0
        self._announced: Optional[dict] = None
        self._seen: Tuple[int, int] = (-1, -1)  # NEXT's (mtime_ns, size) when last read

    def plan(self, step: int) -> Optional[Tuple[str, str, Optional[str]]]:
        """(name, kind, previous) of the export due at ``step``, or None; pserver 0 may announce one."""
        if self.shard == 0:
            due = self._announced
            if (due is None or due["step"] < step) and self.clock() - self._since >= self.seconds:
                self._announce(step + 2)
        else:
            self._read()
        due = self._announced
        if due is None or due["step"] != step:
            return None
        return exports.export_name(step, due["kind"]), due["kind"], due["previous"]

    def _announce(self, at: int) -> None:
        kind = "base" if self._count % self.base_every == 0 else "delta"
        previous = None
        if kind == "delta":
            last = self._announced
            previous = exports.export_name(last["step"], last["kind"])
        self._announced = {"step": at, "kind": kind, "previous": previous}
        os.makedirs(self.root, exist_ok=True)
        atomic_files.write_json(os.path.join(self.root, self.NEXT), self._announced)
        self._count += 1
        self._since = self.clock()

    def _read(self) -> None:
        path = os.path.join(self.root, self.NEXT)
        try:
            st = os.stat(path)
            if (st.st_mtime_ns, st.st_size) == self._seen:
                return
            with open(path, "rb") as f:
                self._announced = json.loads(f.read())
            self._seen = (st.st_mtime_ns, st.st_size)
        except (OSError, ValueError):
            return  # none yet, or being replaced: read at the next step's end


def chain_ids(root: str, name: str, table: str, shard: int, n_shards: int) -> Optional[np.ndarray]:
    """The ids export ``name`` and the exports it follows hold for ``table`` that shard ``shard`` of
    ``n_shards`` owns under today's routing; None if unreadable.

    Walks ``previous`` links back to a base, reading every shard's files of each export (they may have
    been written by another number of pservers, or placed by another routing version), then replays the
    ids and tombstones forward.
    """
    chain = []
    while name is not None:
        folder = os.path.join(root, name, table)
        try:
            dirs = sorted(os.path.join(folder, e) for e in os.listdir(folder) if exports.SHARD_DIR.match(e))
            if not dirs:
                raise ValueError("no shard directory")
            meta = exports_meta(dirs[0])
            ids = [np.load(os.path.join(d, "ids.npy"), allow_pickle=False) for d in dirs]
            gone = [np.load(os.path.join(d, "tombstones.npy"), allow_pickle=False) for d in dirs]
        except (OSError, ValueError) as e:
            log.warning("export %s: table %s is unreadable (%s)", name, table, e)
            return None
        chain.append((np.concatenate(ids), np.concatenate(gone)))
        name = meta.get("previous")
    held = np.empty(0, np.int64)
    for ids, gone in reversed(chain):
        held = np.union1d(np.setdiff1d(held, gone), ids)
    return held[shard_of(held, n_shards) == shard]


def exports_meta(directory: str) -> dict:
    """The ``meta.json`` of one export shard directory."""
    with open(os.path.join(directory, exports.META), "rb") as f:
        return json.loads(f.read())


class TableExporter:
    """Scheduled exports of one pserver's table shards (``tables``: a :class:`TableSet`)."""

    def __init__(
        self,
        tables,
        root: str,
        every: int,
        base_every: int,
        keep_bases: int,
        every_seconds: float = 0.0,
        sync_mode: bool = True,
    ):
        if every_seconds and not sync_mode:
            raise ValueError(
                "export_every_seconds needs sync mode: async pservers apply their steps "
                "independently and cannot agree on one; use export_every"
            )
        self.tables, self.root = tables, root
        self.every, self.base_every, self.keep_bases = every, base_every, keep_bases
        self.schedule = (
            ClockSchedule(root, every_seconds, base_every, tables.shard) if every_seconds else None
        )
        self.shard, self.n_shards = tables.shard, tables.n_shards
        self.resync = True  # nothing exported since start: the first delta is a resync
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="table-export")
        self._writing: Optional[concurrent.futures.Future] = None
        for shard in tables.shards.values():
            shard.life.track_tombstones()

    @classmethod
    def for_program(cls, program, tables) -> Optional["TableExporter"]:
        """The exporter ``program``'s config asks for (``export_dir`` with ``export_every`` or
        ``export_every_seconds``, and tables to export); None otherwise."""
        cfg = program.config
        if cfg.export_dir is None or not (cfg.export_every or cfg.export_every_seconds) or not tables:
            return None
        return cls(
            tables,
            cfg.export_dir,
            cfg.export_every,
            cfg.export_base_every,
            cfg.export_keep_bases,
            cfg.export_every_seconds,
            program.sync_mode,
        )

    def after_update(self, step: int) -> None:
        """Export if one is due at ``step``: copy the shards' changes now, write them in the background."""
        if self.schedule is not None:
            plan = self.schedule.plan(step)
        else:
            plan = export_plan(step, self.every, self.base_every)
        if plan is None:
            return
        name, kind, previous = plan
        self.wait()
        resync = self.resync and kind == "delta"
        parts = {}
        for table, shard in self.tables.shards.items():
            ids, rows, gone = shard.export_changes(full=kind == "base" or resync)
            parts[table] = (ids, rows, gone, shard.step)
        self.resync = False
        self._writing = self._pool.submit(self._write, name, kind, previous, resync, parts)

    def restored(self) -> None:
        """The tables were reloaded (a roll-back): the next delta is a resync."""
        self.wait()
        self.resync = True

    def wait(self) -> None:
        """Wait for the export being written, if any."""
        if self._writing is not None:
            self._writing.result()
            self._writing = None

    def close(self) -> None:
        self.wait()
        self._pool.shutdown(wait=True)

    def _write(
        self, name: str, kind: str, previous: Optional[str], resync: bool, parts: Dict[str, tuple]
    ) -> None:
        try:
            for table, (ids, rows, gone, table_step) in parts.items():
                if resync:
                    held = chain_ids(self.root, previous, table, self.shard, self.n_shards)
                    gone = np.empty(0, np.int64) if held is None else np.setdiff1d(held, ids)
                meta = {
                    "kind": kind,
                    "step": exports.parse_export_name(name)[0],
                    "previous": previous,
                    "table_step": int(table_step),
                    "resync": resync,
                }
                exports.write_export_shard(
                    self.root, name, table, self.shard, self.n_shards, ids, rows, gone, meta
                )
            exports.finish_export_shard(self.root, name, self.shard, self.n_shards)
            if self.shard == 0:
                exports.prune_exports(self.root, self.keep_bases)
            log.info(
                "tables exported: %s (%s%s) by pserver %d of %d",
                name,
                kind,
                ", resync" if resync else "",
                self.shard,
                self.n_shards,
            )
        except Exception:  # a full disk must not stop training; readers keep the previous export
            log.exception(
                "export %s of pserver %d failed; readers stay at the previous complete "
                "export until the next base",
                name,
                self.shard,
            )
