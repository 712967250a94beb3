"""Which lane carries which block when a push-pull is split across several connections to one pserver.

A trainer with ``push_lanes`` > 1 sends a large push-pull to a pserver as
``lanes`` calls at once, each over its own gRPC channel (its own TCP
connection): call ``lane`` carries the gradients of the blocks
:func:`lane_of_blocks` gives that lane and is answered with those blocks; the
tables' tensors (sparse gradients, ids asked ahead) and their rows ride in
lane 0. Both sides compute the same answer from the pserver's blocks, so it is
part of the wire protocol, not a choice either side makes alone.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Sequence, Tuple

# The most connections one push-pull may be split across.
MAX_LANES = 16


def lane_of_blocks(blocks: Iterable[Tuple[str, int]], lanes: int) -> Dict[str, int]:
    """``{block name: lane}`` for a pserver's ``blocks`` ((name, bytes)), bytes balanced over ``lanes`` lanes.

    Largest block first, each to the lane holding the fewest bytes so far
    (the lowest lane on a tie; names break ties between equal blocks), so
    the answer depends only on the set of blocks, not on their order.
    """
    if isinstance(lanes, bool) or not isinstance(lanes, int) or not 1 <= lanes <= MAX_LANES:
        raise ValueError(f"lanes must be in [1, {MAX_LANES}], got {lanes!r}")
    load = [0] * lanes
    out: Dict[str, int] = {}
    for name, nbytes in sorted(blocks, key=lambda b: (-b[1], b[0])):
        lane = min(range(lanes), key=lambda k: (load[k], k))
        out[name] = lane
        load[lane] += nbytes
    return out


def split_by_lane(names: Sequence[str], lane_of: Dict[str, int], lanes: int) -> List[List[int]]:
    """Positions of ``names`` per lane: a block's where :func:`lane_of_blocks` put it, any other name's in
    lane 0."""
    out: List[List[int]] = [[] for _ in range(lanes)]
    for i, name in enumerate(names):
        out[lane_of.get(name, 0)].append(i)
    return out
