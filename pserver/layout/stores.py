"""Where the layout record lives, read and changed by compare-and-set: a file under the job's
``checkpoint_dir`` (:class:`FileLayoutStore`), or etcd when hot standby gives the job one
(:class:`EtcdLayoutStore`). :func:`update` applies a pure transition (:mod:`.phases`) with retries."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from abc import ABC, abstractmethod
from typing import Callable, Iterator, Optional

from transpiler.layout.record import FILE_NAME, LayoutRecord, read_record_file

from .. import atomic_files


class StaleRecord(Exception):
    """The record changed since it was read: read it again."""


class LayoutStore(ABC):
    """One job's layout record."""

    @abstractmethod
    def read(self) -> Optional[LayoutRecord]:
        """The record with its revision; None before the job's first change."""

    @abstractmethod
    def swap(self, expected: Optional[LayoutRecord], new: LayoutRecord) -> LayoutRecord:
        """Write ``new`` if the record is still ``expected`` (None: there is none yet); the record as
        written, with its revision. :class:`StaleRecord` if it changed meanwhile."""

    def close(self) -> None:
        """Release what the store holds (connections)."""


def update(
    store: LayoutStore,
    transition: Callable[[LayoutRecord], LayoutRecord],
    initial: LayoutRecord,
    timeout: float = 10.0,
) -> LayoutRecord:
    """Apply ``transition`` to the stored record (``initial`` when there is none yet) by compare-and-set,
    reading again while others change it; the record written. Errors of the transition (a refusal) pass
    through with nothing written."""
    deadline = time.monotonic() + timeout
    while True:
        current = store.read()
        try:
            return store.swap(current, transition(current if current is not None else initial))
        except StaleRecord:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the layout record kept changing for {timeout:.0f} s") from None


class FileLayoutStore(LayoutStore):
    """The record in ``directory/layout.json`` (the job's ``checkpoint_dir``), compare-and-set under an
    exclusive ``flock`` of ``layout.json.lock``: on a local disk or a shared file system whose locks hold
    across hosts (NFSv4, Lustre, GPFS)."""

    def __init__(self, directory: str):
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.path = os.path.join(directory, FILE_NAME)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.path + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read(self) -> Optional[LayoutRecord]:
        return read_record_file(self.directory)

    def read(self) -> Optional[LayoutRecord]:
        with self._locked():
            return self._read()

    def swap(self, expected: Optional[LayoutRecord], new: LayoutRecord) -> LayoutRecord:
        with self._locked():
            current = self._read()
            if (current.revision if current else None) != (expected.revision if expected else None):
                raise StaleRecord()
            revision = (current.revision if current else 0) + 1
            body = dict(json.loads(new.to_bytes()), revision=revision)
            atomic_files.write_json(self.path, body)
            return new.with_revision(revision)


class EtcdLayoutStore(LayoutStore):
    """The record at ``<prefix>/layout`` in etcd (the hot-standby coordinator), compare-and-set on its
    mod revision."""

    def __init__(self, endpoints: str, prefix: str, timeout: float = 2.0):
        from ..replication.etcd_gateway import Gateway  # imported here: a file store needs no HTTP client

        urls = [u.strip().rstrip("/") for u in endpoints.split(",") if u.strip()]
        if not urls:
            raise ValueError(f"no etcd endpoint in {endpoints!r}")
        self._key = f"{prefix.rstrip('/')}/layout".encode()
        self._gw = Gateway(urls, timeout)

    def read(self) -> Optional[LayoutRecord]:
        kvs = self._gw.call("read the layout record", lambda c: c.get(self._key, metadata=True))
        if not kvs:
            return None
        return LayoutRecord.from_bytes(kvs[0][0], int(kvs[0][1]["mod_revision"]))

    def swap(self, expected: Optional[LayoutRecord], new: LayoutRecord) -> LayoutRecord:
        from ..replication.etcd_gateway import compare, put_request

        target, revision = ("CREATE", 0) if expected is None else ("MOD", expected.revision)
        txn = {
            "compare": [compare(self._key, target, revision)],
            "success": [put_request(self._key, json.loads(new.to_bytes()))],
        }
        answer = self._gw.call("change the layout record", lambda c: c.transaction(txn))
        if not answer.get("succeeded"):
            raise StaleRecord()
        return new.with_revision(int(answer["header"]["revision"]))

    def close(self) -> None:
        self._gw.close()
