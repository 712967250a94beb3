"""A change of layout, step by step, as pure functions of the record: ask, schedule the switch, report each
current pserver's part, commit, roll back; and what Stats shows of it. The pservers apply these by
compare-and-set (:mod:`.stores`, :mod:`.switch`); ``ps-reshard`` asks.

Why a change can always roll back until it commits: no trainer's push after the switch (sync: a step after
``switch_step``; async: a trainer's step from its switch step) is applied anywhere before the commit, and
the state written for it is an ordinary checkpoint. So any failure before the commit abandons the change
and the job goes on in its current layout; after the commit a death is an ordinary one in the new layout
(docs/recovery.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Optional, Sequence

from transpiler.layout.change_checks import (
    LayoutChangeRefused,
    check_backups,
    check_change,
    parsed_pservers,
)
from transpiler.layout.record import LayoutChange, LayoutRecord


def _change(record: LayoutRecord, phases: Sequence[str], doing: str) -> LayoutChange:
    if record.change is None:
        raise LayoutChangeRefused(f"no change of layout is in progress (epoch {record.epoch}) to {doing}")
    if record.change.phase not in phases:
        raise LayoutChangeRefused(
            f"the change to layout epoch {record.change.epoch} is {record.change.phase}; "
            f"it cannot {doing} (it must be {' or '.join(phases)})"
        )
    return record.change


def ask(
    record: LayoutRecord, pservers: Sequence[str], replicas: Sequence[str] = (), now: float = 0.0
) -> LayoutRecord:
    """The record with a change to ``pservers`` asked; refused (:class:`LayoutChangeRefused`) while another
    is in progress, or for a bad list (:func:`transpiler.layout.change.check_change`)."""
    in_progress = record.change.epoch if record.change is not None else None
    pservers = parsed_pservers(pservers)
    check_change(record.pservers, pservers, record.epoch, in_progress)
    if replicas and not record.replicas:
        raise LayoutChangeRefused("the job runs without hot standby: give no replica endpoints")
    replicas = parsed_pservers(replicas) if replicas else []
    if record.replicas:
        check_backups(pservers, replicas)
    change = LayoutChange(record.epoch + 1, list(pservers), list(replicas), "asked", asked_at=now)
    return replace(record, change=change)


def schedule_switch(
    record: LayoutRecord, step: Optional[int], trainer_steps: Optional[Mapping[int, int]] = None
) -> LayoutRecord:
    """Asked -> switching, moving through a checkpoint (no rows copied ahead): sync, at the end of ``step``;
    async, once each trainer's pushes before its step in ``trainer_steps`` ({trainer id: step}) are applied
    (those from it on are refused). Every current pserver then writes its part of that checkpoint and
    reports (:func:`report_saved`)."""
    change = _change(record, ("asked",), "switch")
    steps = {str(t): int(k) for t, k in (trainer_steps or {}).items()}
    at = None if step is None else int(step)
    return replace(record, change=replace(change, phase="switching", switch_step=at, switch_steps=steps))


def report_saved(record: LayoutRecord, endpoint: str, now: float = 0.0) -> LayoutRecord:
    """``endpoint``, a current pserver, wrote its part of the checkpoint at the switch step; once every
    current pserver has, the change commits: the record names the new epoch, its pservers, the step they
    start from, and no change (the next pservers load that checkpoint, re-sharded)."""
    change = _change(record, ("switching",), f"take {endpoint}'s report")
    if endpoint not in record.pservers:
        raise LayoutChangeRefused(f"{endpoint} is not one of the current pservers {record.pservers}")
    saved = sorted(set(change.switched) | {endpoint})
    if set(saved) == set(record.pservers):
        return replace(
            record,
            epoch=change.epoch,
            pservers=change.pservers,
            replicas=change.replicas,
            change=None,
            since_step=change.switch_step if change.switch_step is not None else -1,  # async: per trainer
            history=[*record.history, list(record.pservers)],  # one list a change: a role's start knows them
            last_change_s=max(0.0, now - change.asked_at),
        )
    return replace(record, change=replace(change, switched=saved))


def roll_back(record: LayoutRecord, why: str) -> LayoutRecord:
    """Any phase -> rolling back, for ``why``: every pserver undoes its part (:func:`rolled_back` then)."""
    change = _change(record, ("asked", "switching", "rolling_back"), "roll back")
    return replace(record, change=replace(change, phase="rolling_back", why=why))


def rolled_back(record: LayoutRecord) -> LayoutRecord:
    """Rolling back -> no change: the job runs its current layout as before the change was asked."""
    change = _change(record, ("rolling_back",), "finish rolling back")
    return replace(record, change=None, rolled_back=change.why)


GO_ON, ROLL_BACK, MOVED = "go on", "roll back", "moved"


def on_new_primary(record: Optional[LayoutRecord], epoch: int, shard: str) -> str:
    """What a shard's backup that takes the lead (hot standby) does about its job's layout, serving layout
    ``epoch`` as shard ``shard`` (its pserver endpoint): :data:`MOVED` if ``record`` names a later epoch
    (the change committed while it was the backup: it answers "moved"); :data:`ROLL_BACK` if a change is
    switching and the shard is a current pserver (its primary was lost mid-switch: whether the shard's
    part was written is unknown to it, and the switch step may be behind it); else :data:`GO_ON`."""
    if record is None:
        return GO_ON
    if record.epoch > epoch:
        return MOVED
    change = record.change
    if change is not None and change.phase == "switching" and shard in record.pservers:
        return ROLL_BACK
    return GO_ON


@dataclass(frozen=True)
class LayoutStatus:
    """What Stats, ``ps-stat`` and ``/metrics`` show of the job's layout: the change in progress (``change``,
    "" for none) and its progress (current pservers whose part is written, of ``to_move``), and how long the
    last change took; ``epoch``: the layout epoch the job runs (a pserver not yet moved on may serve an
    earlier one)."""

    change: str = ""
    moved: int = 0
    to_move: int = 0
    last_change_s: float = 0.0
    epoch: int = 0


def status_of(record: Optional[LayoutRecord]) -> LayoutStatus:
    """The :class:`LayoutStatus` of ``record`` (None: the job has none)."""
    if record is None:
        return LayoutStatus()
    change = record.change
    if change is None:
        return LayoutStatus(last_change_s=record.last_change_s, epoch=record.epoch)
    where = ""
    if change.switch_step is not None:
        where = f" after step {change.switch_step}"
    elif change.switch_steps:
        where = " at each trainer's switch step"
    text = f"{change.phase} to epoch {change.epoch} ({len(change.pservers)} pservers){where}"
    if change.phase == "rolling_back":
        text += f": {change.why}"
    written = len(set(change.switched) & set(record.pservers))
    return LayoutStatus(text, written, len(record.pservers), record.last_change_s, record.epoch)
