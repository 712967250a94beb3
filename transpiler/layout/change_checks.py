"""The checks that refuse a bad change of a running job's pserver count, before anything changes: pure,
and free of torch, so ``ps-reshard`` starts at once (:mod:`.change` makes the next layout's plans)."""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

from ..roles.common import parse_endpoints

MAX_PSERVERS = 1 << 15  # the most pservers a layout routes to (transpiler.layout.routing)

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
    available to it now) for what it takes beyond what it already holds; one whose free memory is not
    known (missing from ``free_bytes``: a pserver not started yet) is not checked."""
    total = sum(state_bytes.values())
    share = -(-total // max(1, len(pservers_next)))
    short = []
    for ep in (ep for ep in pservers_next if ep in free_bytes):
        takes = max(0, share - state_bytes.get(ep, 0))
        room = int(free_bytes.get(ep, 0) * MEMORY_HEADROOM)
        if takes > room:
            short.append(f"{ep} would take {takes:,} bytes with {room:,} to spare")
    if short:
        raise LayoutChangeRefused(
            f"the job's {total:,} bytes of blocks and table rows do not fit {len(pservers_next)} "
            f"pservers: " + "; ".join(short)
        )


def parsed_pservers(pservers_next: Sequence[str]) -> list:
    """``pservers_next`` as checked endpoints; :class:`LayoutChangeRefused` for none or a malformed one."""
    if isinstance(pservers_next, str):
        pservers_next = pservers_next.split(",")
    if not [ep for ep in pservers_next if ep.strip()]:
        raise LayoutChangeRefused("a job needs at least one pserver; asked for 0")
    try:
        return parse_endpoints(list(pservers_next))
    except ValueError as e:
        raise LayoutChangeRefused(str(e)) from None


def check_backups(pservers: Sequence[str], replicas: Sequence[str]) -> None:
    """Refuse hot standby's backups ``replicas`` for ``pservers``: one each, in the pservers' order, and no
    endpoint listed twice among both."""
    if len(replicas) != len(pservers):
        raise LayoutChangeRefused(
            f"with hot standby every pserver comes with its backup: give {len(pservers)} replica endpoints"
            f" (--replicas), in the pservers' order; got {len(replicas)}"
        )
    both = [*pservers, *replicas]
    twice = sorted({ep for ep in both if both.count(ep) > 1})
    if twice:
        raise LayoutChangeRefused(f"endpoints {twice} are listed more than once among pservers and replicas")
