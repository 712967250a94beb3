"""Slurm's compressed lists, expanded in Slurm's own order.

A node list (``SLURM_STEP_NODELIST``: ``"node[07,01-04],gpu[1-2]"``) names nodes in the order
Slurm places tasks on them, which need not be sorted: ``scontrol show hostnames`` keeps the
order written. ClusterShell's NodeSet, the maintained parser used here, sorts what it expands;
so the list is checked with NodeSet, then each top-level piece, and each comma-separated
range inside its brackets, is expanded in the order written (ranges by ClusterShell's
RangeSet, which keeps zero padding). A tasks-per-node list (``"2(x3),1"``) repeats counts.
"""

from __future__ import annotations

import itertools
import re
from typing import List, Tuple

from ClusterShell.NodeSet import RESOLVER_NOGROUP, NodeSet, NodeSetException
from ClusterShell.RangeSet import RangeSet, RangeSetException

_NODELIST_CHARS = re.compile(r"^[A-Za-z0-9._\-\[\],]+$")
_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def expand_nodelist(text: str, variable: str) -> List[str]:
    """The node names of a Slurm node list, in Slurm's order; raises ValueError naming ``variable``."""
    text = text.strip()
    if not text or not _NODELIST_CHARS.match(text):
        raise ValueError(f"{variable}={text!r} is not a Slurm node list (e.g. 'node[01-04,07],gpu1')")
    try:
        # No group resolver: '@group' is not Slurm syntax, and resolving would read config files.
        members = set(NodeSet(text, resolver=RESOLVER_NOGROUP))
        nodes = [name for piece in _split_outside_brackets(text, variable) for name in _expand_piece(piece)]
    except (NodeSetException, RangeSetException) as e:
        raise ValueError(f"{variable}={text!r} is not a Slurm node list: {e}") from None
    dupes = sorted({n for n in nodes if nodes.count(n) > 1})
    if dupes:
        raise ValueError(f"{variable}={text!r} names nodes twice: {dupes}")
    if set(nodes) != members:  # the ordered expansion must name exactly the nodes ClusterShell reads
        raise ValueError(f"{variable}={text!r} is not a Slurm node list: it reads as {sorted(members)}")
    return nodes


def tasks_per_node(text: str, variable: str) -> List[int]:
    """Expand ``"2(x3),1"`` to ``[2, 2, 2, 1]``; raises ValueError naming ``variable``."""
    counts: List[int] = []
    for item in text.strip().split(","):
        match = _TASKS.match(item.strip())
        if match is None or int(match[1]) < 1 or (match[2] is not None and int(match[2]) < 1):
            raise ValueError(f"{variable}={text!r} is not a tasks-per-node list (e.g. '2(x3),1')")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def block_layout(nodes: List[str], counts: List[int]) -> List[Tuple[str, int]]:
    """(node, slot on that node) of every task, by Slurm's default block distribution.

    Node 0 runs tasks ``0 .. counts[0]-1``, node 1 the next ``counts[1]``, and so on.
    """
    return [(node, slot) for node, count in zip(nodes, counts) for slot in range(count)]


def _split_outside_brackets(text: str, variable: str) -> List[str]:
    pieces, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if depth not in (0, 1):
            raise ValueError(f"{variable}={text!r} has unbalanced or nested brackets")
        if char == "," and depth == 0:
            pieces.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"{variable}={text!r} has an unclosed bracket")
    pieces.append(text[start:])
    if not all(pieces):
        raise ValueError(f"{variable}={text!r} has an empty name")
    return pieces


def _expand_piece(piece: str) -> List[str]:
    """``"rack[2,1]-n[01-02]"`` -> rack2-n01, rack2-n02, rack1-n01, rack1-n02 (brackets in order, first
    outermost)."""
    parts = re.split(r"(\[[^\]]*\])", piece)
    choices = []
    for part in parts:
        if part.startswith("["):
            choices.append([value for item in part[1:-1].split(",") for value in RangeSet(item)])
        else:
            choices.append([part])
    return ["".join(combo) for combo in itertools.product(*choices)]
