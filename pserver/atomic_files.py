"""Atomic file writes: a reader sees the old file or the whole new one, never a part.

Every write goes to a temporary name in the same directory, is fsynced and
renamed over the target; directories are fsynced after renames so the new
name survives a crash. Table shard files (:mod:`pserver.tables.files`) and
checkpoints (:mod:`pserver.checkpoint`) are both written through here.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Iterator


def fsync_dir(directory: str) -> None:
    """Make the entries of ``directory`` (a rename into it) durable."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def replacing(path: str) -> Iterator[str]:
    """A temporary path next to ``path``; once the block succeeds it is fsynced and renamed to
    ``path`` (readers see the old file or the whole new one), otherwise removed."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write(path: str, write) -> None:
    """Write ``path`` atomically: ``write(f)`` fills a temporary file that replaces it."""
    with replacing(path) as tmp, open(tmp, "wb") as f:
        write(f)


def write_json(path: str, data: dict) -> None:
    """Write ``data`` as indented JSON to ``path``, atomically."""
    atomic_write(path, lambda f: f.write(json.dumps(data, indent=1, sort_keys=True).encode()))
