"""Where a parked call's CPU stretches run: on the server's event loop when nothing in them can block, else
in the pool.

A parking servicer method (:mod:`.parking`) runs in stretches: from its start to its first wait, from each
wait's end to the next, up to its answers (decode a push, count or apply it, read and encode the answer).
In the handler pool each stretch costs two thread hops and the GIL handed back and forth; run on the loop
itself it costs neither (job S, 2 x 2, sync: +16% examples/s, 0.3-1.1 ms less pserver CPU per push;
benchmarks/results/RESULTS.md). But while a stretch runs on the loop no other call arrives or is answered,
so a stretch may run there only if nothing in it can block: :func:`stretch_place` decides that from the
pserver's program, and :class:`Stretches` keeps the loop off the engine's lock while a call in the pool
holds it across I/O.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from typing import Iterator, List, Optional, Tuple

from transpiler import PserverProgram

log = logging.getLogger(__name__)

# How long a call that is about to hold the engine's lock across I/O waits for the loop to finish the
# stretch it runs (stretches are milliseconds; past this the loop is wedged, and waiting longer helps nobody).
LOOP_PASS_S = 10.0


def what_blocks(program: PserverProgram) -> List[str]:
    """What in this pserver's stretches can block (empty: nothing), each with why; a pure function of
    ``program``.

    Read from the code, each of these runs inside a stretch (or holds the engine's lock, which every push
    takes, across I/O):

    - ``server_replicas=2`` (hot standby): every answer waits for the backup's acknowledgement of the
      updates it reports (``CallerChecks.acked``: a network round trip to another process), and every
      update is handed to the replication stream under the engine's lock.
    - ``checkpoint_dir``: with ``checkpoint_every`` the stretch that completes a step writes the checkpoint
      under the engine's lock (:class:`~pserver.engine.listeners.ScheduledCheckpoints`); without it still a
      trainer's close or drop records the closed trainers beside the checkpoints (a file write on shared
      storage, under the lock, from a handler or the heartbeat watchdog), and Checkpoint, Restore and the
      shutdown checkpoint write or load one under the lock.
    - ``export_every`` / ``export_every_seconds``: the stretch that completes a step waits for the previous
      export's write to finish, and the clock schedule reads and writes ``export_dir/NEXT``
      (:class:`~pserver.tables.serving.exporter.TableExporter`).
    - a table with ``ram_rows`` (the disk tier): a lookup or update of an evicted row reads it back from
      LMDB, and a step's end spills rows to it (:mod:`pserver.tables.lifecycle.tiering`).

    Not ruled out, and why: SaveTables holds the engine's lock across its file writes, but runs in the pool
    and first moves the stretches off the loop (:meth:`Stretches.off_loop`); a trainer's shared-memory
    region is mapped once (local memory, bounded per trainer: :mod:`.mapped_regions`); every other lock a
    stretch takes (the engine's, a table shard's, the Reduce service's, the receive buffers') is held for
    CPU work only.
    """
    cfg = program.config
    found = []
    if program.replicated:
        found.append("server_replicas=2: each answer waits for the backup's acknowledgement")
    if cfg.checkpoint_dir is not None:
        found.append(
            "checkpoint_dir: checkpoints and the record of closed trainers are written under the "
            "engine's lock"
        )
    if cfg.export_dir is not None and (cfg.export_every or cfg.export_every_seconds):
        found.append("export_every: a step's end waits for the previous export's write")
    disk = sorted(t.name for t in program.tables if t.lifecycle.ram_rows)
    if disk:
        found.append(f"ram_rows (the disk tier) on tables {disk}: evicted rows are read back from disk")
    return found


def stretch_place(program: PserverProgram) -> Tuple[bool, str]:
    """(whether parked calls' stretches run on the event loop, why); a pure function of ``program``.

    On the loop when ``pserver_stretches_on_loop`` allows it, the training is
    synchronous and nothing in a stretch can block (:func:`what_blocks`); in
    the pool otherwise. Async training stays in the pool by measurement: it
    gained nothing on the loop (job S, 2 x 2: 1.00x), and under a thousand
    trainers' pushes, each applied by its own stretch as it arrives, the
    loop's stretches left it no turns to take calls up: trainers whose
    heartbeats waited past ``heartbeat_timeout`` were dropped (K = 1,024).
    """
    if not program.config.pserver_stretches_on_loop:
        return False, "pserver_stretches_on_loop=False"
    if not program.sync_mode:
        return False, "asynchronous training: every push's stretch would hold up the loop's taking calls up"
    blocking = what_blocks(program)
    if blocking:
        return False, "; ".join(blocking)
    return True, "nothing in them blocks"


def answered_on_loop(method):
    """Mark a unary servicer method whose whole call runs on the server's event loop, never in the pool.

    For a method that only reads and writes memory without waiting (a heartbeat: the session
    check, a counter, the engine's lock-free ``touch``): its pool hop would cost more than its
    work (two thread switches and the GIL handed back and forth), and behind a thousand async
    pushes it would wait for a pool thread while its trainer waits for the answer.
    """

    @functools.wraps(method)
    def on_loop(self, request, context):
        return method(self, request, context)

    on_loop.answered_on_loop = True
    return on_loop


class Stretches:
    """Whether a stretch may start on the loop now: ``allowed`` (:func:`stretch_place`) and no call holds
    the lock across I/O.

    :meth:`bind` names the loop once it runs. A call in the pool that is about to hold the engine's lock
    across I/O (SaveTables) enters :meth:`off_loop` first: stretches start in the pool until it leaves, so
    the loop never waits for that lock.
    """

    def __init__(self, allowed: bool):
        self.allowed = allowed
        self._holding = 0  # calls in off_loop now
        self._lock = threading.Lock()
        self._loop = None
        self._loop_thread: Optional[int] = None

    @classmethod
    def placed(cls, program: PserverProgram) -> "Stretches":
        """``program``'s pserver's stretches, on the loop or not as :func:`stretch_place` decides (logged)."""
        on_loop, why = stretch_place(program)
        log.info(
            "pserver %s: parked calls' stretches run %s (%s)",
            program.endpoint,
            "on the event loop" if on_loop else "in the handler pool",
            why,
        )
        return cls(on_loop)

    def bind(self, loop) -> None:
        """On ``loop``'s thread: the loop whose stretches this governs."""
        self._loop, self._loop_thread = loop, threading.get_ident()

    def on_loop(self) -> bool:
        """Whether a stretch starting now runs on the loop (read on the loop)."""
        return self.allowed and self._holding == 0

    def in_loop_thread(self) -> bool:
        """Whether the caller is the loop's thread."""
        return threading.get_ident() == self._loop_thread

    @contextlib.contextmanager
    def off_loop(self) -> Iterator[None]:
        """Around a call that holds the engine's lock across I/O: no stretch runs on the loop meanwhile.

        Entering waits for one pass of the loop: a stretch that began on it
        before has ended then, and every later one starts in the pool. No-op
        where stretches never run on the loop.
        """
        loop = self._loop
        if not self.allowed or loop is None:
            yield
            return
        with self._lock:
            self._holding += 1
        try:
            if not self.in_loop_thread():
                passed = threading.Event()
                try:
                    loop.call_soon_threadsafe(passed.set)
                except RuntimeError:  # the loop is closed: no stretch runs on it any more
                    passed.set()
                if not passed.wait(LOOP_PASS_S):
                    log.warning("the event loop did not finish its stretch within %gs; going on", LOOP_PASS_S)
            yield
        finally:
            with self._lock:
                self._holding -= 1
