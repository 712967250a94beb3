"""What went wrong with a pserver, in the trainer's words: :class:`PserverError` and its kinds.

The transport (:mod:`trainer.transport`) is the one place that reads the wire's status codes: it maps
each once to a kind below, and recovery (:mod:`trainer.recovery`) and node
groups decide on the kind alone, knowing nothing of gRPC.

========  =======================================================  ====================
kind      what happened                                            recovery
========  =======================================================  ====================
DOWN      the pserver is unreachable, restarting or shutting down  wait for it, re-sync
RESYNC    the pserver asks for a re-sync: this trainer was         re-sync (Hello)
          dropped, the pserver rolled back or restarted
FENCED    a newer process took this trainer id over                stop: stale gradients
TIMEOUT   a wait on the pserver ran out (a barrier names who is    the error reaches the
          missing)                                                 user
MOVED     the job changed its pserver count: the answer names the  adopt that layout, push
          layout it runs now                                       the step again there
REFUSED   anything else: bad input, a precondition, a bug          the error reaches the
                                                                   user
========  =======================================================  ====================
"""

from __future__ import annotations

DOWN, RESYNC, FENCED, TIMEOUT, MOVED, REFUSED = "down", "resync", "fenced", "timeout", "moved", "refused"
KINDS = (DOWN, RESYNC, FENCED, TIMEOUT, MOVED, REFUSED)


class PserverError(RuntimeError):
    """A pserver refused or failed a request; the message names it.

    ``kind`` is one of :data:`KINDS`; ``status`` names what the pserver or the
    transport said (e.g. ``"UNAUTHENTICATED"``), for people, not for decisions.
    """

    def __init__(self, endpoint: str, message: str, kind: str = REFUSED, status: str = ""):
        if kind not in KINDS:
            raise ValueError(f"unknown PserverError kind {kind!r}; one of {KINDS}")
        super().__init__(f"pserver {endpoint}: {message}")
        self.endpoint = endpoint
        self.kind = kind
        self.status = status


class PserverUnavailableError(PserverError, TimeoutError):
    """A pserver did not come up within the connect deadline."""

    def __init__(self, endpoint: str, message: str, status: str = "UNAVAILABLE"):
        super().__init__(endpoint, message, DOWN, status)


class FencedError(PserverError):
    """A newer process of this trainer id took it over: this one must stop (its gradients are stale)."""

    def __init__(self, endpoint: str, message: str, status: str = ""):
        super().__init__(endpoint, message, FENCED, status)


class StepMoved(Exception):
    """A step's push (of ``step``) was answered "moved" (``error``, kind MOVED): the job runs another layout
    now. Carries the step's table gradients, not yet routed ({table: (unique ids, rows)}), to push there."""

    def __init__(self, error: PserverError, table_grads, step: int):
        super().__init__(str(error))
        self.error = error
        self.table_grads = table_grads
        self.step = step
