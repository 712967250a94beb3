"""Checkpointer: when one pserver writes checkpoints and how it loads one back.

The file layout and its crash safety are :mod:`pserver.checkpoint.layout`'s; this
class binds them to one pserver's blocks and tables. The engine calls it under
its lock, so every checkpoint is taken at a step boundary.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple, Optional

from ..store import BlockStore
from ..tables import TableSet
from . import layout

log = logging.getLogger(__name__)


class LastCheckpoint(NamedTuple):
    """The latest checkpoint a pserver wrote or loaded: its step, this pserver's part, when (Unix time)."""

    step: int
    path: str
    time: float


class Checkpointer:
    """Writes this pserver's part of checkpoints under ``root`` and loads checkpoints back.

    ``every``: a checkpoint whenever the engine's update count is a multiple of it
    (0: only when asked). ``keep``: this pserver's newest parts kept on disk.
    """

    def __init__(
        self,
        root: str,
        store: BlockStore,
        tables: TableSet,
        shard: int,
        n_shards: int,
        endpoint: str,
        sync_mode: bool,
        every: int = 0,
        keep: int = 3,
    ):
        self.root = root
        self.store = store
        self.tables = tables
        self.shard = shard
        self.n_shards = n_shards
        self.endpoint = endpoint
        self.sync_mode = sync_mode
        self.every = every
        self.keep = keep
        # The latest checkpoint written or loaded.
        self.last: Optional[LastCheckpoint] = None

    @classmethod
    def for_program(cls, program, store: BlockStore, tables: TableSet) -> Optional["Checkpointer"]:
        """The checkpointer ``program``'s config asks for (``checkpoint_dir``, ``_every``, ``_keep``); None
        without a ``checkpoint_dir``."""
        cfg = program.config
        if cfg.checkpoint_dir is None:
            return None
        shards = len(program.pservers)
        return cls(
            cfg.checkpoint_dir,
            store,
            tables,
            program.shard,
            shards,
            program.endpoint,
            program.sync_mode,
            every=cfg.checkpoint_every,
            keep=cfg.checkpoint_keep,
        )

    def due(self, version: int) -> bool:
        """Whether the engine, having just reached ``version`` updates, should write a checkpoint."""
        return (
            self.every > 0
            and version > 0
            and version % self.every == 0
            and (self.last is None or self.last.step != version)
        )

    def save(self, version: int, roster_meta: dict) -> str:
        """Write this pserver's part at ``version`` (blocks, optimizer state, tables, trainers)."""
        started = time.monotonic()
        path = layout.write_part(
            self.root,
            version,
            self.shard,
            self.n_shards,
            self.store,
            self.tables,
            {**roster_meta, "endpoint": self.endpoint, "sync_mode": self.sync_mode},
        )
        layout.prune(self.root, self.shard, self.n_shards, self.keep)
        self.last = LastCheckpoint(version, path, time.time())
        log.info(
            "%s: checkpoint at step %d written to %s in %.2fs",
            self.endpoint,
            version,
            path,
            time.monotonic() - started,
        )
        return path

    def load(self, step: Optional[int] = None) -> Optional[dict]:
        """Load the latest complete checkpoint (or the one at ``step``) into the blocks and tables.

        Returns this pserver's view of its manifest (step and trainers), or None
        if there is none. The saved job may have had another number of
        pservers. Nothing changes when loading fails (ValueError).
        """
        saved = layout.find_saved(self.root, self.sync_mode, step, self.shard)
        if saved is None:
            return None
        blocks = layout.load_blocks(saved.parts)
        # Everything is read and checked before anything changes.
        shards = self.tables.load_shards(
            {name: layout.table_directories(saved, name) for name in self.tables.names()}
        )
        self.store.restore(blocks)
        self.tables.install(shards)
        same = saved.n_shards == self.n_shards
        manifest = saved.manifests[self.shard if same else 0]
        self.last = LastCheckpoint(
            saved.step, saved.parts[self.shard] if same else saved.parts[0], time.time()
        )
        log.info(
            "%s: loaded the checkpoint at step %d from %d pserver part(s) under %s",
            self.endpoint,
            saved.step,
            saved.n_shards,
            self.root,
        )
        # Trainers that closed after the checkpoint was written are gone too.
        closed = set(manifest.get("closed", [])) | layout.read_closed(self.root, self.shard, self.n_shards)
        return {**manifest, "step": saved.step, "closed": sorted(closed)}

    def note_closed(self, closed) -> None:
        """Record at once which trainers have closed (a failure is logged, never raised)."""
        try:
            layout.write_closed(self.root, self.shard, self.n_shards, closed)
        except OSError:
            log.exception(
                "%s: could not record the closed trainers %s under %s; a restart from an "
                "older checkpoint would wait for them",
                self.endpoint,
                sorted(closed),
                self.root,
            )

    def forget_after(self, version: int) -> None:
        """Delete this pserver's parts newer than ``version``: a roll-back abandoned them."""
        layout.prune(self.root, self.shard, self.n_shards, self.keep, newer_than=version)
