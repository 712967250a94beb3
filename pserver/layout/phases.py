"""A change of layout, step by step, as pure functions of the record: ask, copy, switch, commit, roll back,
and what a death during a change decides. The pservers' coordination applies these by compare-and-set
(:mod:`.stores`); ``ps-reshard`` asks.

Why a change can always roll back until it commits: the old owners keep every row they send (they drop
the moved slots only once the record names the new epoch), and in sync mode no trainer's step after
``switch_step`` is applied anywhere before the commit. So any death before the commit abandons the change
and the job goes on in its current layout; after the commit a death is an ordinary one in the new
layout (docs/recovery.md).
"""

from __future__ import annotations

from dataclasses import replace
from typing import List, Mapping, Optional, Sequence

from transpiler.layout.change import LayoutChangeRefused, check_change, parsed_pservers
from transpiler.layout.record import LayoutChange, LayoutRecord

GO_ON = "go on"
ROLL_BACK = "roll back"


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
    if record.replicas and len(replicas) != len(pservers):
        raise LayoutChangeRefused(
            f"with hot standby every pserver comes with its backup: give {len(pservers)} replica endpoints"
        )
    change = LayoutChange(record.epoch + 1, list(pservers), list(replicas), "asked", asked_at=now)
    return replace(record, change=change)


def involved(record: LayoutRecord) -> List[str]:
    """Every pserver a change involves: the current ones, then the new ones (each once)."""
    if record.change is None:
        return list(record.pservers)
    return list(record.pservers) + [ep for ep in record.change.pservers if ep not in record.pservers]


def start_copying(record: LayoutRecord) -> LayoutRecord:
    """Asked -> copying: every new pserver is up; the old owners stream the moving rows."""
    change = _change(record, ("asked",), "start copying")
    return replace(record, change=replace(change, phase="copying"))


def switch_at(record: LayoutRecord, step: int) -> LayoutRecord:
    """Copying -> switching at the end of ``step``: every pserver sends the rest, installs what it receives
    and reports (:func:`report_switched`)."""
    change = _change(record, ("copying",), "switch")
    return replace(record, change=replace(change, phase="switching", switch_step=int(step)))


def report_switched(record: LayoutRecord, endpoint: str) -> LayoutRecord:
    """``endpoint`` sent and received its part of the switch; once every pserver involved has, the change
    commits: the record names the new epoch and no change."""
    change = _change(record, ("switching",), f"take {endpoint}'s report")
    everyone = involved(record)
    if endpoint not in everyone:
        raise LayoutChangeRefused(f"{endpoint} is not one of the pservers of the change {everyone}")
    switched = sorted(set(change.switched) | {endpoint})
    if set(switched) == set(everyone):
        return replace(
            record, epoch=change.epoch, pservers=change.pservers, replicas=change.replicas, change=None
        )
    return replace(record, change=replace(change, switched=switched))


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


def report_saved(record: LayoutRecord, endpoint: str) -> LayoutRecord:
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
        )
    return replace(record, change=replace(change, switched=saved))


def roll_back(record: LayoutRecord, why: str) -> LayoutRecord:
    """Any phase -> rolling back, for ``why``: every pserver undoes its part (:func:`rolled_back` then)."""
    change = _change(record, ("asked", "copying", "switching", "rolling_back"), "roll back")
    return replace(record, change=replace(change, phase="rolling_back", why=why))


def rolled_back(record: LayoutRecord) -> LayoutRecord:
    """Rolling back -> no change: the job runs its current layout as before the change was asked."""
    change = _change(record, ("rolling_back",), "finish rolling back")
    return replace(record, change=None, rolled_back=change.why)


def on_death(record: LayoutRecord, endpoint: str, role: str) -> str:
    """What the death of ``endpoint`` (``role`` "pserver" or "trainer") decides for a change in progress:
    :data:`ROLL_BACK` for any pserver the change involves before it commits, :data:`GO_ON` otherwise (a
    trainer's death is the sync barrier's business, not the layout's)."""
    if role not in ("pserver", "trainer"):
        raise ValueError(f"role must be 'pserver' or 'trainer', got {role!r}")
    if record.change is None or role == "trainer" or record.change.phase == "rolling_back":
        return GO_ON
    return ROLL_BACK if endpoint in involved(record) else GO_ON


def epoch_of(record: LayoutRecord, endpoint: str) -> Optional[int]:
    """The layout epoch ``endpoint`` serves now: the record's if it is one of its pservers, the change's
    if it is only a new one (None: neither)."""
    if endpoint in record.pservers:
        return record.epoch
    if record.change is not None and endpoint in record.change.pservers:
        return record.change.epoch
    return None
