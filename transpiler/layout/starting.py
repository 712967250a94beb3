"""The layout a role starts in, from its job's layout record: pure decisions, table-tested.

A role is started with a pserver list (the environment's, or flags). Once its job has changed its pserver
count, that list may be an earlier one (a supervisor starts a role again with the command it started with),
the list of the change in progress (a new pserver started right after ``ps-reshard`` asked), or one the
job never had (the operator started the whole job again on another list, from its checkpoint). The record
(:mod:`.record`) knows the job's lists: its pservers now, those of earlier epochs, and the change's.
"""

from __future__ import annotations

from typing import Optional, Sequence

from .change import program_in
from .change_checks import LayoutChangeRefused
from .record import LayoutRecord, read_record_file

FOLLOW = "follow"  # start in the layout the record names now
WAIT = "wait"  # a pserver the record does not name yet: wait for it to (a change adding it commits)
LEFT = "left"  # a pserver an earlier change removed: it has left the job, it starts nothing
NEW = "new"  # a list the job never had: the job starts again on it (a pserver records it)


def start_in(
    record: Optional[LayoutRecord],
    pservers: Sequence[str],
    endpoint: Optional[str] = None,
    recorded_serving: bool = False,
) -> str:
    """How a role given ``pservers`` starts (a pserver: the one at ``endpoint``; a trainer: None) in its job
    whose record is ``record`` (None: none yet); ``recorded_serving``: whether a pserver the record names
    (other than ``endpoint``) serves now, which tells a job that runs from one restarted on a new list.
    :class:`LayoutChangeRefused` for a list the job never had while a change is in progress: it cannot
    start again on another list mid-change."""
    if record is None:
        return NEW
    change = record.change
    known = [list(record.pservers), *map(list, record.history)] + ([list(change.pservers)] if change else [])
    if list(pservers) not in known:
        if change is not None:
            raise LayoutChangeRefused(
                f"the job is changing its pserver count to {change.pservers} (layout epoch {change.epoch}); "
                f"start its roles with its pservers {record.pservers} or those"
            )
        # No pserver of the record serves: the job starts again on a new list, which a pserver records. One
        # does: the job runs, and a pserver started before its change was asked (or whose change was rolled
        # back) waits for a change that adds it, never overwriting the layout of a job that runs.
        return WAIT if endpoint is not None and recorded_serving else NEW
    # With hot standby a shard's backup is as much in a layout as its pserver.
    if endpoint is None or endpoint in record.processes:
        return FOLLOW
    if change is not None and endpoint in change.processes:
        return WAIT
    return LEFT


def trainer_program_now(program):
    """A trainer's ``program`` in the layout its job runs now, as its record (``checkpoint_dir``) says."""
    record = read_record_file(program.config.checkpoint_dir)
    if start_in(record, program.pservers) == FOLLOW:
        return program_in(program, record)
    return program
