"""The plan a pserver process starts with, in the layout its job's record names
(:mod:`transpiler.layout.starting` decides): a pserver new to the job waits for the change that adds it to
commit; one an earlier change removed has left the job; one started on a list the job never had records
it (the job starts again on it).
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Optional

from transpiler import PserverProgram
from transpiler.layout.change import program_in, recorded_layout
from transpiler.layout.starting import FOLLOW, LEFT, NEW, start_in

from .stores import FileLayoutStore, StaleRecord

log = logging.getLogger(__name__)

POLL_S = 0.05  # how often a pserver waiting to join reads the record


def _serving(endpoint: str, timeout: float = 0.5) -> bool:
    """Whether something accepts connections at ``endpoint`` (a pserver of the record that still serves)."""
    host, port = endpoint.rsplit(":", 1)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


class LeftJob(RuntimeError):
    """A pserver an earlier change of its job's pserver count removed was started: it serves nothing."""


def pserver_program_now(program: PserverProgram, timeout: Optional[float] = None) -> PserverProgram:
    """``program`` (a pserver's or, with hot standby, a backup's) in the layout its job runs now (``program``
    itself without a checkpoint_dir); a pserver the change in progress adds waits up to ``timeout`` s
    (default ``barrier_timeout``) for its commit (``TimeoutError`` if it does not come). :class:`LeftJob`
    for a pserver the job no longer has."""
    cfg = program.config
    if not cfg.checkpoint_dir:
        return program
    store = FileLayoutStore(cfg.checkpoint_dir)
    deadline = time.monotonic() + (cfg.barrier_timeout if timeout is None else timeout)
    waiting = False
    while True:
        record = store.read()
        recorded = record.processes if record is not None else []
        serving = any(_serving(ep) for ep in recorded if ep != program.endpoint)
        how = start_in(record, program.pservers, program.endpoint, serving)
        if how == FOLLOW:
            return program_in(program, record)
        if how == LEFT:
            raise LeftJob(
                f"pserver {program.endpoint} left the job when it changed its pserver count; it now runs "
                f"{record.pservers} (layout epoch {record.epoch})"
            )
        if how == NEW:
            try:
                store.swap(record, recorded_layout(program))
            except StaleRecord:
                continue
            if record is not None:
                log.warning(
                    "pserver %s: the job starts again on %s (its record named %s, layout epoch %d)",
                    program.endpoint,
                    program.pservers,
                    record.pservers,
                    record.epoch,
                )
            return program
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"pserver {program.endpoint}: the change of layout that adds it did not commit in time"
            )
        if not waiting:
            log.info("pserver %s: waiting for the change of layout that adds it", program.endpoint)
            waiting = True
        time.sleep(POLL_S)
