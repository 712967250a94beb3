"""A change of a running job's pserver count: the checks that refuse a bad one, and the plans of the next
layout. Pure: the pservers' coordination (which asks, records and announces a change) calls these.

A change keeps every other setting of the plan; it gives the layout a new epoch, the blocks a new cut
and placement (:func:`.dense_blocks.place_params`, as a transpile for that many pservers would), and the
tables' slots their owners for the new count (:mod:`.routing`). Grow a job by appending pservers and
shrink it by removing the last ones: that moves the least (:mod:`.moves`). Any other new list is allowed
and moves more (a pserver at a new position owns that position's slots).
"""

from __future__ import annotations

import dataclasses
import re
from typing import List, Optional, Sequence, Tuple

from ..plans import PserverProgram, TrainerProgram
from ..roles.replicas import replica_endpoints
from .change_checks import LayoutChangeRefused, check_backups, check_change, parsed_pservers
from .dense_blocks import layout_digest, place_params, shapes_of
from .record import LayoutRecord


def _next_config(config, pservers_next: Sequence[str], replicas_next: Optional[Sequence[str]]):
    """The plan's config for the next pservers: their replicas listed with them (hot standby)."""
    if (config.server_replicas or 1) < 2:
        return config
    replicas_next = list(replicas_next or [])
    check_backups(pservers_next, replicas_next)
    return dataclasses.replace(config, replica_endpoints=",".join(replicas_next))


def _layout_at(program, pservers, replicas, epoch: int):
    """(pservers, config, params, epoch, digest) of ``program``'s job on ``pservers`` at layout ``epoch``: the
    blocks cut and placed again, the epoch's digest."""
    config = _next_config(program.config, pservers, replicas)
    params = place_params(shapes_of(program.params), pservers, config)
    digest = layout_digest(
        params, program.trainers, program.sync_mode, program.optimizer, program.tables, config, epoch
    )
    return pservers, config, params, epoch, digest


def _next_layout(program, pservers_next, replicas_next, epoch: Optional[int]):
    """:func:`_layout_at` the next epoch (or a later ``epoch``, a role that missed changes), the change
    checked."""
    pservers_next = parsed_pservers(pservers_next)
    if epoch is None:
        epoch = program.layout_epoch + 1
        check_change(program.pservers, pservers_next, program.layout_epoch)
    elif epoch <= program.layout_epoch:
        raise LayoutChangeRefused(f"layout epoch {epoch} is not after this plan's {program.layout_epoch}")
    else:
        check_change((), pservers_next, program.layout_epoch)
    return _layout_at(program, pservers_next, replicas_next, epoch)


def next_trainer_program(
    program: TrainerProgram,
    pservers_next: Sequence[str],
    replicas_next: Optional[Sequence[str]] = None,
    epoch: Optional[int] = None,
) -> TrainerProgram:
    """``program`` for the layout after a change to ``pservers_next``: the next epoch (or ``epoch``, later),
    its blocks and digest; the trainer, its model and every setting unchanged."""
    pservers, config, params, epoch, digest = _next_layout(program, pservers_next, replicas_next, epoch)
    return dataclasses.replace(
        program, pservers=pservers, params=params, config=config, layout_digest=digest, layout_epoch=epoch
    )


def next_pserver_program(
    program: PserverProgram,
    pservers_next: Sequence[str],
    endpoint: str,
    replicas_next: Optional[Sequence[str]] = None,
    epoch: Optional[int] = None,
) -> PserverProgram:
    """The plan of the pserver (or replica) at ``endpoint`` in the layout after a change of ``program``'s
    job to ``pservers_next`` (the next epoch, or ``epoch``, later); ``endpoint`` may be new to the job."""
    if not program.params:
        raise LayoutChangeRefused(
            f"the plan of {program.endpoint} lists only its own blocks (it was made before layouts could "
            f"change): restart the job's roles from a checkpoint to change its pserver count"
        )
    return _pserver_program(program, endpoint, *_next_layout(program, pservers_next, replicas_next, epoch))


def _pserver_program(
    program: PserverProgram, endpoint: str, pservers, config, params, epoch: int, digest: str
):
    """``program`` (a pserver's, of any layout) as the plan of the pserver at ``endpoint`` in the layout
    given."""
    owner = next((g[0] for g in replica_endpoints(config, pservers) if endpoint in g), None)
    if owner is None:
        raise LayoutChangeRefused(f"{endpoint} is not one of the next pservers {pservers}")
    return dataclasses.replace(
        program,
        endpoint=endpoint,
        pservers=pservers,
        blocks=[b for p in params for b in p.blocks if b.endpoint == owner],
        config=config,
        layout_digest=digest,
        params=params,
        layout_epoch=epoch,
    )


def check_later_layout(now: TrainerProgram, program: TrainerProgram) -> None:
    """Refuse (:class:`LayoutChangeRefused`) a trainer's adopting ``program`` in place of ``now``: it must be
    a later layout of the same job (the same trainer, trainers, mode, optimizer and tables)."""
    same = ("trainer_id", "trainers", "sync_mode", "optimizer", "tables")
    if program.layout_epoch <= now.layout_epoch or any(getattr(program, f) != getattr(now, f) for f in same):
        raise LayoutChangeRefused(
            f"trainer {now.trainer_id}: the plan to adopt must be a later layout of this job (epoch "
            f"{now.layout_epoch + 1} or later, the same trainers, mode, optimizer and tables); got epoch "
            f"{program.layout_epoch}"
        )


def program_in(program, record: Optional[LayoutRecord]):
    """``program`` (a trainer's or a pserver's plan) in the layout ``record`` names: its epoch and pservers
    (a role started after its job changed its pserver count, or with another list of the job's); ``program``
    itself if it is that layout already, or if there is no record."""
    if record is None or (
        record.epoch == program.layout_epoch and list(record.pservers) == list(program.pservers)
    ):
        return program
    pservers, config, params, epoch, digest = _layout_at(
        program, parsed_pservers(record.pservers), record.replicas or None, record.epoch
    )
    if isinstance(program, TrainerProgram):
        return dataclasses.replace(
            program, pservers=pservers, params=params, config=config, layout_digest=digest, layout_epoch=epoch
        )
    return _pserver_program(program, program.endpoint, pservers, config, params, epoch, digest)


# A pserver that no longer serves a trainer's layout says where the job went, in its answer's text: the
# one channel both transports carry. The trainer reads it back with :func:`moved_to`.
_MOVED = "moved to layout epoch {epoch}: pservers {pservers}"
_MOVED_PATTERN = re.compile(r"moved to layout epoch (\d+): pservers (\S+)(?: replicas (\S+))?")


def moved_message(epoch: int, pservers: Sequence[str], replicas: Sequence[str] = ()) -> str:
    """The text of a "moved" answer: the job runs layout ``epoch`` on ``pservers`` (and, with hot standby,
    their ``replicas``)."""
    text = _MOVED.format(epoch=int(epoch), pservers=",".join(pservers))
    return text + (f" replicas {','.join(replicas)}" if replicas else "")


def moved_to(message: str) -> Optional[Tuple[int, List[str], Optional[List[str]]]]:
    """(epoch, pservers, replicas or None) a "moved" answer's text names (:func:`moved_message`), None if it
    names none."""
    found = _MOVED_PATTERN.search(message)
    if found is None:
        return None
    replicas = found.group(3).split(",") if found.group(3) else None
    return int(found.group(1)), found.group(2).split(","), replicas


def replicas_of(program) -> List[str]:
    """The hot-standby backups of ``program``'s pservers, in their order (none without replicas)."""
    return [g[1] for g in replica_endpoints(program.config, program.pservers) if len(g) > 1]


def recorded_layout(program) -> LayoutRecord:
    """The record of a job that has not changed its layout: ``program``'s epoch, pservers and replicas."""
    return LayoutRecord(program.layout_epoch, list(program.pservers), replicas_of(program))
