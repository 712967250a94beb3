"""Why a pserver refuses a request, in the domain's terms.

The engines, the stores and the servicer's checks raise these; only the RPC
layer turns them into gRPC status codes (the ``STATUS`` table of
:mod:`pserver.rpc.prologue`), so nothing below the servicer depends on the transport. Any other
exception reaching the servicer is a bug and is answered INTERNAL.
"""

from __future__ import annotations


class Refusal(Exception):
    """Base of every deliberate refusal: the request is answered with ``message`` and changes nothing.

    Raise a subclass; the servicer maps each subclass to a status code, and a
    refusal it does not know maps to nothing (INTERNAL), so new kinds must be
    added to its table.
    """

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class BadRequest(Refusal, ValueError):
    """The request itself is malformed or invalid, whatever the pserver's state.

    Unknown or repeated names, wrong shapes or dtypes, trainer ids out of
    range, ids of another shard, a negative step or version, a missing header
    or directory, NaN/Inf gradients. Also a ``ValueError``, because the same
    checks serve file loading and direct callers that catch ``ValueError``.
    """


class NotAllowed(Refusal):
    """A well-formed request that the pserver's current state does not allow; retrying as is won't help.

    A push from a closed trainer, a plan (layout digest) mismatch, a stale
    step, a step or version beyond the next one, Checkpoint or Restore
    without a checkpoint_dir, a Restore to a step with no complete
    checkpoint, Restore on an async pserver.
    """


class StorageFailed(Refusal):
    """The files a request needs could not be written or read.

    SaveTables or Checkpoint hit an OSError, or the checkpoint a Restore
    names cannot be read or does not fit this pserver's plan. The pserver
    itself keeps its state and goes on serving.
    """


class MustResync(Refusal):
    """The trainer's view of the job is out of date: it must call Hello again, then carry on.

    It was dropped after ``heartbeat_timeout``, or this pserver rolled back
    to a checkpoint while it waited, or resumed from a checkpoint and is now
    behind the step the trainer pushes or waits for.
    """


class ShuttingDown(Refusal):
    """The pserver is stopping; a waiting call is released so the server can exit.

    The trainer should retry against the restarted pserver.
    """


class BarrierTimeout(Refusal):
    """A barrier or staleness wait outlasted ``barrier_timeout``; the message names the missing trainers."""


class NoSession(Refusal):
    """A call for a trainer id that carries no session: nobody said Hello for it from this caller.

    A stray or hand-made message (a port scanner, a client pointed at the
    wrong port): it must not speak for a trainer, so it changes nothing.
    """


class Fenced(Refusal):
    """A call with a session that a newer process of the same trainer id replaced.

    The caller is an old process that was presumed dead (a paused VM, a
    healed partition): it must stop instead of pushing stale gradients.
    """


class Unauthenticated(Refusal):
    """A data connection without the job's auth token (the gRPC port's interceptor refuses calls so)."""


class AlreadyRunning(Refusal):
    """A Hello for a trainer id whose session is alive, from another process.

    Two processes were started with the same trainer id; the message names
    the id and where the live one connects from.
    """


class Moved(Refusal):
    """The job left the layout the caller runs: it now runs layout ``epoch`` on ``pservers`` (with hot
    standby, backed up by ``replicas``) (docs/operations.md, "Growing and shrinking a job"). The trainer
    adopts that layout and calls there."""

    def __init__(self, message: str, epoch: int, pservers, replicas=()):
        from transpiler.layout.change import moved_message

        super().__init__(f"{message}; {moved_message(epoch, pservers, replicas)}")
        self.epoch = epoch
        self.pservers = list(pservers)
        self.replicas = list(replicas)


class NotPrimary(Refusal):
    """Hot standby: this process does not lead its shard now (a backup, joining, or fenced).

    The trainer asks the shard's processes who leads and sends the call there.
    """


class OutOfSync(Refusal):
    """Hot standby: a replication message this backup cannot apply (a gap, or an older epoch's).

    The primary stops counting this backup as in sync; the backup copies its state again.
    """


class LostLead(RuntimeError):
    """Hot standby: :meth:`ParameterServer.serve` ended because this process lost the lead (was fenced).

    Not a refusal: the process stops; started again, it rejoins as the backup.
    """
