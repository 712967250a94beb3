"""The job's layout record: the pservers of the current layout epoch and the change in progress, if any.

One record per job, kept where the job's coordination lives (:mod:`pserver.layout.stores`: etcd with hot
standby, otherwise a file under ``checkpoint_dir``) and changed only by compare-and-set, so two operators or
two pservers never both start a change, and every role reads one answer. The transitions are pure
(:mod:`pserver.layout.phases`). It lives with the plans because every role reads it: a trainer or pserver
that starts after a change starts in the layout the record names (:func:`read_record_file`).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Dict, List, Optional

FORMAT = "torch-pserver-layout"
FILE_NAME = "layout.json"  # the record's file under checkpoint_dir (without hot standby)
VERSION = 1

# A change's phases, in order. "asked": recorded (its new pservers may start); "switching": at the end of
# ``switch_step`` (sync; async: each trainer's step in ``switch_steps``) every current pserver writes its
# part and reports (``switched``); "rolling_back": abandoned, the current layout stays.
PHASES = ("asked", "switching", "rolling_back")


@dataclass(frozen=True)
class LayoutChange:
    """A change in progress: to ``epoch``, run by ``pservers`` (and their ``replicas`` with hot standby)."""

    epoch: int
    pservers: List[str]
    replicas: List[str] = field(default_factory=list)
    phase: str = "asked"
    switch_step: Optional[int] = None
    switch_steps: Dict[str, int] = field(default_factory=dict)  # async: each trainer's first step refused
    switched: List[str] = field(default_factory=list)  # current pservers whose part is written
    asked_at: float = 0.0
    why: str = ""  # why it rolls back

    @property
    def processes(self) -> List[str]:
        """Every process of the next layout: its pservers and, with hot standby, their backups."""
        return [*self.pservers, *self.replicas]


@dataclass(frozen=True)
class LayoutRecord:
    """The layout ``epoch`` the job runs (``pservers``, ``replicas``) and the ``change`` in progress.

    ``revision`` is the store's version of the record (not part of its bytes): a compare-and-set names it.
    """

    epoch: int
    pservers: List[str]
    replicas: List[str] = field(default_factory=list)
    change: Optional[LayoutChange] = None
    since_step: int = -1  # the step this epoch's pservers started from (its checkpoint); -1: the job's start
    rolled_back: str = ""  # why the last change asked was rolled back ("": none was)
    history: List[List[str]] = field(default_factory=list)  # the pservers of each earlier epoch, oldest first
    last_change_s: float = 0.0  # how long the last change took, from the ask to the commit
    revision: int = 0

    @property
    def processes(self) -> List[str]:
        """Every process of the layout the job runs: its pservers and, with hot standby, their backups."""
        return [*self.pservers, *self.replicas]

    def to_bytes(self) -> bytes:
        """The record as JSON (without its revision)."""
        d = asdict(self)
        d.pop("revision")
        return json.dumps({"format": FORMAT, "version": VERSION, **d}, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes, revision: int = 0) -> "LayoutRecord":
        """A record read back; ``ValueError`` naming what is wrong with malformed bytes."""
        try:
            d = json.loads(bytes(data).decode())
        except (UnicodeDecodeError, ValueError) as e:
            raise ValueError(f"not a layout record: {e}") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError("not a layout record")
        if d.get("version") != VERSION:
            raise ValueError(f"layout record version {d.get('version')!r}, this build reads {VERSION}")
        try:
            change = d.get("change")
            return cls(
                int(d["epoch"]),
                list(d["pservers"]),
                list(d.get("replicas", [])),
                None if change is None else LayoutChange(**change),
                int(d.get("since_step", -1)),
                str(d.get("rolled_back", "")),
                [list(p) for p in d.get("history", [])],
                float(d.get("last_change_s", 0.0)),
                revision,
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed layout record: {e}") from None

    def with_revision(self, revision: int) -> "LayoutRecord":
        """This record as the store holds it at ``revision``."""
        return replace(self, revision=revision)


def read_record_file(directory: Optional[str]) -> Optional[LayoutRecord]:
    """The record in ``directory``'s :data:`FILE_NAME` (a job's ``checkpoint_dir``), None if there is none
    (or no directory).

    Lock-free: the file is only ever replaced whole (written aside, renamed), so a read sees one record.
    ``ValueError`` for a file that is not a record.
    """
    if not directory:
        return None
    path = os.path.join(directory, FILE_NAME)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    try:
        revision = int(json.loads(data)["revision"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a layout record ({e})") from None
    return LayoutRecord.from_bytes(data, revision)
