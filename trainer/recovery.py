"""Recovery: what a trainer does when a pserver call fails in a way that can heal.

A pserver that is briefly unreachable, restarted from a checkpoint, or that
dropped this trainer for silence answers UNAVAILABLE or ABORTED (CANCELLED
while it shuts down). The trainer then waits for every pserver (``hello``,
with gRPC's reconnect backoff, up to ``recovery_timeout``) and decides by
what they say:

- nobody restarted: retry the same step (pushes are idempotent per (trainer,
  step)); when the others went on without this trainer, skip to their step;
  when the pservers were rolled back meanwhile, go back to their step;
- async, somebody restarted: retry; the restarted pserver lost its updates
  since its checkpoint, nothing else is rolled back;
- somebody restarted without a checkpoint: fail (its parameters are gone);
- sync, somebody restarted: every other pserver rolls back to the restarted
  ones' checkpoint (``Restore``, once per restart: the token names it), and
  the trainer resumes at that step and that data position.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Dict, Sequence, Tuple

import grpc

from psproto import ps_pb2

from .communicator import Communicator, PserverError

log = logging.getLogger(__name__)

# CANCELLED: what a call in flight gets from a pserver that is shutting down (SIGTERM, a restart).
RECOVERABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED)

RETRY, SKIP, ROLLBACK = "retry", "skip", "rollback"


@dataclass
class Resync:
    """The outcome of :func:`resync`: ``action`` is RETRY the step, SKIP to ``step``, or ROLLBACK to it."""

    action: str
    step: int
    position: Tuple[int, int]
    incarnations: Dict[str, int]


def recoverable(error: BaseException) -> bool:
    """Whether ``error`` (from a step's calls) may heal by waiting and re-syncing."""
    return isinstance(error, PserverError) and error.code in RECOVERABLE


def resync(comm: Communicator, failure: PserverError, sync_mode: bool, incarnations: Dict[str, int],
           step: int, push_endpoints: Sequence[str], deadline: float, what: str) -> Resync:
    """Wait for every pserver until ``deadline`` (monotonic) and decide how step ``step`` goes on.

    ``what`` names the failed calls in the log ("step 7", "joining").

    Raises :class:`PserverError` when a pserver stays away past the deadline,
    or restarted without a checkpoint in sync mode (its parameters are lost).
    """
    log.warning("trainer %d: %s failed (%s); waiting up to %.0fs for the pservers", comm.trainer_id,
                what, failure, max(0.0, deadline - time.monotonic()))
    replies: Dict[str, ps_pb2.HelloReply] = comm.hello(max(0.1, deadline - time.monotonic()))
    now = {ep: r.incarnation for ep, r in replies.items()}
    restarted = sorted(ep for ep in replies if now[ep] != incarnations.get(ep))
    for ep in restarted:
        log.warning("trainer %d: pserver %s restarted (from the checkpoint at step %d)", comm.trainer_id,
                    ep, replies[ep].checkpoint_version)
    lost = [ep for ep in restarted if replies[ep].checkpoint_version < 0]
    if lost:
        raise PserverError(", ".join(lost), "restarted without a checkpoint, so the parameters it held "
                           "are lost; set checkpoint_dir to survive pserver restarts",
                           grpc.StatusCode.FAILED_PRECONDITION)
    if restarted and sync_mode:
        # Every other pserver goes back to the restarted ones' checkpoint; then all stand at
        # that step and the general case below rolls this trainer back to it.
        target = min(replies[ep].checkpoint_version for ep in restarted)
        token = ",".join(f"{ep}#{now[ep]}" for ep in restarted)
        others = [ep for ep in replies if ep not in restarted or replies[ep].checkpoint_version != target]
        comm.run_parallel({ep: (lambda ep=ep: comm.restore(ep, target, token)) for ep in others})
        if others:  # their answers predate the roll-back
            replies = comm.hello(max(0.1, deadline - time.monotonic()))
    versions = {ep: replies[ep].version for ep in push_endpoints} if sync_mode else {}
    if versions and max(versions.values()) > step:
        ahead = max(versions.values())
        log.warning("trainer %d: the other trainers went on without this one (dropped after "
                    "heartbeat_timeout?); rejoining at step %d", comm.trainer_id, ahead)
        return Resync(SKIP, ahead, (0, 0), now)
    if versions and min(versions.values()) < step:
        # Rolled back to a checkpoint (on this trainer's request or another's).
        source = min(versions, key=versions.get)
        position = (replies[source].epoch, replies[source].batch)
        log.warning("trainer %d: every pserver is back at the checkpoint of step %d; steps %d..%d are "
                    "redone from data position epoch %d batch %d", comm.trainer_id, versions[source],
                    versions[source], step, *position)
        return Resync(ROLLBACK, versions[source], position, now)
    log.info("trainer %d: pservers are back; retrying step %d", comm.trainer_id, step)
    return Resync(RETRY, step, (0, 0), now)
