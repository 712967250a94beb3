"""Backup trainers' side of a sync step: the trainers a push says make the step, and pushes dropped from it.

With ``backup_trainers`` the first pserver decides which trainers make each sync step (the Claim
service, :mod:`pserver.engine.services.claims`). Every push then names them (``step_trainers``), and a
trainer left out pushes its step ``dropped``, carrying nothing: acknowledged, its data position kept,
never counted. The sync handler (:mod:`.sync`) waits for exactly the step's trainers, as its first push
named them (:meth:`pserver.engine.pending.PendingStep.admit`), and lets a dropped trainer leave the step
(:meth:`pserver.engine.pending.PendingStep.drop`). Here: those decisions, pure, and their refusals.
"""

from __future__ import annotations

from typing import AbstractSet, Optional, Sequence

from ...errors import BadRequest, NotAllowed
from .mode import AHEAD, BACKUP_FIELDS, DUPLICATE, NEW, Arrival


def check_sync_push(dropped: bool, grads, sparse) -> None:
    """Refuse (:class:`BadRequest`) a dropped push that carries gradients: it has none to give."""
    if dropped and (grads or sparse):
        raise BadRequest(BACKUP_FIELDS)


def dropped_arrival(step: int, pserver_step: int, counted: bool) -> Arrival:
    """What a dropped push of ``step`` is at a pserver at ``pserver_step`` (``counted``: the trainer's push
    of the step in progress is counted already).

    NEW: the trainer leaves the step in progress; AHEAD: refused; DUPLICATE: a past step's, or one the
    trainer's gradients already count in, acknowledged and nothing more.
    """
    if step > pserver_step:
        return AHEAD
    if step == pserver_step and not counted:
        return NEW
    return DUPLICATE


def made_of_others(
    endpoint: str,
    trainer_id: int,
    step: int,
    step_trainers: Sequence[int],
    admitted: Optional[AbstractSet[int]],
) -> NotAllowed:
    """The refusal of a push that names other trainers for its step than the step's first push did."""
    return NotAllowed(
        f"pserver {endpoint}: trainer {trainer_id} pushed step {step} as made of "
        f"trainers {sorted(step_trainers)}, but the step is made of "
        f"{sorted(admitted)}"
    )
