"""What scripted stand-ins for ``trainer.transport.Channels`` share."""

from __future__ import annotations

from trainer.errors import PserverError


def run_parallel(jobs):
    """``Channels.run_parallel``'s contract, in turn: every job runs; the first PserverError is raised
    after."""
    results, error = {}, None
    for ep, job in jobs.items():
        try:
            results[ep] = job()
        except PserverError as e:
            error = error or e
    if error is not None:
        raise error
    return results
