"""SIGTERM and Ctrl-C, for a process that serves until told to stop: recorded by the handler, acted on by
the serving loop (:func:`serve_until`)."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from typing import Iterator, List

log = logging.getLogger(__name__)

POLL_S = 0.1  # how soon the loop acts on a signal its handler recorded


@contextlib.contextmanager
def recorded() -> Iterator[List[int]]:
    """In the block, SIGTERM and SIGINT are appended to the list yielded instead of handled (on the main
    thread only: elsewhere none can be caught); the handlers before are put back after.

    The handler only records: it runs on the main thread between two bytecodes, maybe while that thread
    holds the lock of an Event's condition (entering its wait) or of a log handler, and a handler that took
    either lock would wait for itself for ever (a SIGTERM that never stopped the process).
    """
    previous, received = {}, []
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda signum, frame: received.append(signum))
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def serve_until(finished: threading.Event, received: List[int], name: str) -> None:
    """Block until ``finished`` is set, setting it on the first signal ``received`` (:func:`recorded`);
    ``name`` says who shuts down, in the log."""
    while not finished.wait(POLL_S):
        if received:
            log.info("%s: %s received, shutting down", name, signal.Signals(received[0]).name)
            finished.set()
