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
from typing import Mapping, Optional, Sequence

from ..plans import PserverProgram, TrainerProgram
from ..roles.common import parse_endpoints
from ..roles.replicas import replica_endpoints
from .dense_blocks import layout_digest, place_params, shapes_of
from .routing import MAX_PSERVERS

# A new owner must have this much of its free memory left after taking its share (the rest: the
# interpreter, buffers of the move itself, the page cache the checkpoints use).
MEMORY_HEADROOM = 0.8


class LayoutChangeRefused(ValueError):
    """A change of pserver count that cannot be made; nothing was changed."""


def check_change(
    pservers_now: Sequence[str],
    pservers_next: Sequence[str],
    epoch_now: int,
    in_progress: Optional[int] = None,
) -> None:
    """Refuse (:class:`LayoutChangeRefused`) a change from ``pservers_now`` at layout ``epoch_now`` to
    ``pservers_next``: no pservers, too many, an endpoint twice, the same list, or a change to
    epoch ``in_progress`` not yet finished."""
    if in_progress is not None:
        raise LayoutChangeRefused(
            f"a change to layout epoch {in_progress} is in progress (from epoch {epoch_now}); ask again "
            f"once it has finished (ps-stat shows its progress)"
        )
    if not pservers_next:
        raise LayoutChangeRefused("a job needs at least one pserver; asked for 0")
    if len(pservers_next) > MAX_PSERVERS:
        raise LayoutChangeRefused(f"at most {MAX_PSERVERS} pservers; asked for {len(pservers_next)}")
    twice = sorted({ep for ep in pservers_next if list(pservers_next).count(ep) > 1})
    if twice:
        raise LayoutChangeRefused(f"pservers {twice} are listed more than once")
    if list(pservers_next) == list(pservers_now):
        raise LayoutChangeRefused(
            f"the job already runs on these {len(pservers_now)} pservers (layout epoch {epoch_now})"
        )


def check_fit(
    state_bytes: Mapping[str, int], free_bytes: Mapping[str, int], pservers_next: Sequence[str]
) -> None:
    """Refuse a change after which a pserver would hold more than it can: the job's state
    (``state_bytes``: each pserver's blocks and table rows now, by endpoint) spread evenly over
    ``pservers_next``, each of which must keep :data:`MEMORY_HEADROOM` of its ``free_bytes`` (memory
    available to it now) for what it takes beyond what it already holds."""
    total = sum(state_bytes.values())
    share = -(-total // max(1, len(pservers_next)))
    short = []
    for ep in pservers_next:
        takes = max(0, share - state_bytes.get(ep, 0))
        room = int(free_bytes.get(ep, 0) * MEMORY_HEADROOM)
        if takes > room:
            short.append(f"{ep} would take {takes:,} bytes with {room:,} to spare")
    if short:
        raise LayoutChangeRefused(
            f"the job's {total:,} bytes of blocks and table rows do not fit {len(pservers_next)} "
            f"pservers: " + "; ".join(short)
        )


def _parsed(pservers_next: Sequence[str]) -> list:
    """``pservers_next`` as checked endpoints; :class:`LayoutChangeRefused` for none or a malformed one."""
    if isinstance(pservers_next, str):
        pservers_next = pservers_next.split(",")
    if not [ep for ep in pservers_next if ep.strip()]:
        raise LayoutChangeRefused("a job needs at least one pserver; asked for 0")
    try:
        return parse_endpoints(list(pservers_next))
    except ValueError as e:
        raise LayoutChangeRefused(str(e)) from None


def _next_config(config, pservers_next: Sequence[str], replicas_next: Optional[Sequence[str]]):
    """The plan's config for the next pservers: their replicas listed with them (hot standby)."""
    if (config.server_replicas or 1) < 2:
        return config
    if replicas_next is None or len(replicas_next) != len(pservers_next):
        raise LayoutChangeRefused(
            f"with hot standby every pserver comes with its backup: give {len(pservers_next)} replica "
            f"endpoints, in the pservers' order"
            + (f" (got {len(replicas_next)})" if replicas_next is not None else "")
        )
    both = list(pservers_next) + list(replicas_next)
    twice = sorted({ep for ep in both if both.count(ep) > 1})
    if twice:
        raise LayoutChangeRefused(f"endpoints {twice} are listed more than once among pservers and replicas")
    return dataclasses.replace(config, replica_endpoints=",".join(replicas_next))


def _next_layout(program, pservers_next, replicas_next):
    """(pservers, config, params, epoch, digest) of the layout after ``program``'s job changes to
    ``pservers_next``: checked, the blocks cut and placed again, the next epoch and its digest."""
    pservers_next = _parsed(pservers_next)
    check_change(program.pservers, pservers_next, program.layout_epoch)
    config = _next_config(program.config, pservers_next, replicas_next)
    params = place_params(shapes_of(program.params), pservers_next, config)
    epoch = program.layout_epoch + 1
    digest = layout_digest(
        params, program.trainers, program.sync_mode, program.optimizer, program.tables, config, epoch
    )
    return pservers_next, config, params, epoch, digest


def next_trainer_program(
    program: TrainerProgram, pservers_next: Sequence[str], replicas_next: Optional[Sequence[str]] = None
) -> TrainerProgram:
    """``program`` for the layout after a change to ``pservers_next``: the next epoch, its blocks and
    digest; the trainer, its model and every setting unchanged."""
    pservers, config, params, epoch, digest = _next_layout(program, pservers_next, replicas_next)
    return dataclasses.replace(
        program, pservers=pservers, params=params, config=config, layout_digest=digest, layout_epoch=epoch
    )


def next_pserver_program(
    program: PserverProgram,
    pservers_next: Sequence[str],
    endpoint: str,
    replicas_next: Optional[Sequence[str]] = None,
) -> PserverProgram:
    """The plan of the pserver (or replica) at ``endpoint`` in the layout after a change of ``program``'s
    job to ``pservers_next``; ``endpoint`` may be new to the job."""
    if not program.params:
        raise LayoutChangeRefused(
            f"the plan of {program.endpoint} lists only its own blocks (it was made before layouts could "
            f"change): restart the job's roles from a checkpoint to change its pserver count"
        )
    pservers, config, params, epoch, digest = _next_layout(program, pservers_next, replicas_next)
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
