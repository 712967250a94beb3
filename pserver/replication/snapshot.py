"""A copy of a primary's state for a joining backup: its checkpoint part, archived and streamed.

The primary writes its part with the checkpoint code (blocks, optimizer state,
table shards with their disk tier and lifecycle state, the trainers' progress)
into a scratch directory under the engine's lock, so the copy stands at one
update, and archives it; the backup unpacks the archive into its own scratch
directory and loads it as a checkpoint. Nothing touches ``checkpoint_dir``.
"""

from __future__ import annotations

import logging
import os
import shutil
import tarfile
import tempfile
from typing import Iterable, Iterator

from ..checkpoint import Checkpointer

log = logging.getLogger(__name__)

CHUNK = 1 << 20


def _checkpointer(engine, program, directory: str, alone: bool = False) -> Checkpointer:
    # Written as the only part of a one-pserver checkpoint (``alone``): complete by itself, and
    # loaded by the backup as shard k of n like any checkpoint of another pserver count.
    shard, n = (0, 1) if alone else (program.shard, len(program.pservers))
    return Checkpointer(
        directory, engine.store, engine.tables, shard, n, program.endpoint, program.sync_mode, every=0, keep=1
    )


def scratch(program) -> str:
    """A new scratch directory for a snapshot (under ``table_disk_dir`` when set: local disk)."""
    return tempfile.mkdtemp(prefix="ps-snapshot-", dir=program.config.table_disk_dir)


def write(engine, program, directory: str) -> str:
    """Under the engine's lock: this process's state as a checkpoint part in ``directory``, archived; the
    archive."""
    _checkpointer(engine, program, directory, alone=True).save(engine.step, engine.roster.to_meta())
    archive = os.path.join(directory, "snapshot.tar")
    with tarfile.open(archive, "w") as tar:
        for entry in sorted(os.listdir(directory)):
            if entry != "snapshot.tar":
                tar.add(os.path.join(directory, entry), arcname=entry)
    return archive


def chunks(archive: str) -> Iterator[bytes]:
    """The archive's bytes, a chunk at a time."""
    with open(archive, "rb") as f:
        while True:
            data = f.read(CHUNK)
            if not data:
                return
            yield data


def unpack(data: Iterable[bytes], directory: str) -> None:
    """Write the streamed archive into ``directory`` and unpack it there."""
    archive = os.path.join(directory, "snapshot.tar")
    with open(archive, "wb") as f:
        for piece in data:
            f.write(piece)
    with tarfile.open(archive) as tar:
        tar.extractall(directory, filter="data")
    os.remove(archive)


def load(engine, program, directory: str) -> dict:
    """Under the engine's lock: load the unpacked snapshot in ``directory`` into the blocks and tables; its
    manifest.

    The engine takes its step and roster from it (:meth:`~pserver.engine.Engine.follow_copy`).
    """
    meta = _checkpointer(engine, program, directory).load()
    if meta is None:
        raise ValueError(f"the snapshot in {directory} holds no complete checkpoint part")
    return meta


def remove(directory: str) -> None:
    shutil.rmtree(directory, ignore_errors=True)
