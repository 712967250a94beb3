"""One pserver process across its job's changes of layout: the plan it starts with, read from the layout
record, and a next generation of its :class:`~pserver.server.ParameterServer` at each change it stays in.

A process keeps its endpoint (and so its ports) across a change; what it serves changes at the switch step
(:mod:`.switch`): the generation that stopped there hands over to one built for the next layout, which
loads the checkpoint of that step re-sharded, as a pserver restarted at another count would, without the
process going away. A pserver new to the job, or one restarted after a change, starts in the layout the
record names, waiting for the change that adds it to commit.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from psproto.security import Security
from transpiler import PserverProgram, StartupProgram
from transpiler.layout.change import program_in
from transpiler.layout.record import read_record_file

from ..server import ParameterServer

log = logging.getLogger(__name__)

POLL_S = 0.05  # how often a pserver waiting to join reads the record


def current_program(program: PserverProgram, timeout: Optional[float] = None) -> PserverProgram:
    """``program`` in the layout its job's record names now (``program`` itself without a record, or when
    the record names its layout); a pserver not in that layout waits up to ``timeout`` s (default
    ``barrier_timeout``) for a change that adds it to commit. ``TimeoutError`` if none does."""
    cfg = program.config
    if not cfg.checkpoint_dir:
        return program
    timeout = cfg.barrier_timeout if timeout is None else timeout
    deadline, logged = time.monotonic() + timeout, False
    record = read_record_file(cfg.checkpoint_dir)
    while record is not None and program.endpoint not in record.pservers:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"pserver {program.endpoint} is not one of the job's pservers {record.pservers} (layout "
                f"epoch {record.epoch}) and no change adding it committed within {timeout:.0f}s; ask for one "
                f"with ps-reshard"
            )
        if not logged:
            log.info("pserver %s: waiting for a change of layout that adds it", program.endpoint)
            logged = True
        time.sleep(POLL_S)
        record = read_record_file(cfg.checkpoint_dir)
    return program_in(program, record)


def serve_layouts(
    program: PserverProgram,
    startup: Optional[StartupProgram] = None,
    tables_from: Optional[str] = None,
    security: Optional[Security] = None,
) -> None:
    """Serve ``program`` (see :meth:`ParameterServer.serve`), then each next layout of its job this pserver
    stays in, until the job ends, a signal stops it, or it leaves the job."""
    server = ParameterServer(program, startup, tables_from, security)
    while True:
        server.serve()
        moved = server.layout.moved if server.layout is not None else None
        if moved is None or program.endpoint not in moved.pservers:
            return
        program = program_in(server.program, moved)
        log.info(
            "pserver %s: starting layout epoch %d (%d pservers) from step %d",
            program.endpoint,
            program.layout_epoch,
            len(program.pservers),
            moved.since_step,
        )
        server = ParameterServer(program, None, security=security)
