"""A job's dense layout: every parameter cut into row blocks and the blocks dealt to pservers, and the
digest of everything trainers and pservers must agree on. Pure: a transpile and a change of pserver count
(:mod:`.change`) compute a layout the same way."""

from __future__ import annotations

import hashlib
import json
import math
from typing import List, Sequence, Tuple

from ..config import DistributeTranspilerConfig
from ..optim import OptimizerSpec
from ..placement import DISPATCHERS, block_count, split_rows
from ..plans import BlockSpec, ParamSpec
from ..tables import TableSpec

# (name, shape, dtype name) of a dense parameter, in the program's order.
ParamShape = Tuple[str, List[int], str]


def place_params(
    shapes: Sequence[ParamShape], pservers: Sequence[str], config: DistributeTranspilerConfig
) -> List[ParamSpec]:
    """Every parameter of ``shapes`` sliced into blocks (``config.slice_var_up``, ``min_block_size``) and
    the blocks dealt to ``pservers`` by ``config.split_method``; no pservers (collective mode): no
    blocks."""
    dispatcher = DISPATCHERS[config.split_method](list(pservers)) if pservers else None
    params: List[ParamSpec] = []
    for name, shape, dtype in shapes:
        shape = list(shape)
        if dispatcher is None:
            params.append(ParamSpec(name, shape, dtype, []))
            continue
        rows = shape[0] if shape else 1
        n = block_count(math.prod(shape), rows, len(pservers), config.min_block_size, config.slice_var_up)
        names = [f"{name}.block{i}" for i in range(n)]
        placed = dispatcher.dispatch(names)
        blocks = [
            BlockSpec(bn, name, i, start, end, ([end - start] + shape[1:]) if shape else [], dtype, ep)
            for i, (bn, (start, end), ep) in enumerate(zip(names, split_rows(rows, n), placed))
        ]
        params.append(ParamSpec(name, shape, dtype, blocks))
    return params


def shapes_of(params: Sequence[ParamSpec]) -> List[ParamShape]:
    """The (name, shape, dtype) of every parameter of a layout, to place them again."""
    return [(p.name, list(p.shape), p.dtype) for p in params]


def layout_digest(
    params: Sequence[ParamSpec],
    trainers: int,
    sync_mode: bool,
    optimizer: OptimizerSpec,
    tables: Sequence[TableSpec],
    config: DistributeTranspilerConfig,
    layout_epoch: int = 0,
) -> str:
    """A short hash of everything both sides must agree on; checked at Hello and on every call."""
    blob = json.dumps(
        {
            "params": [
                [p.name, p.shape, p.dtype, [[b.name, b.row_start, b.row_end, b.endpoint] for b in p.blocks]]
                for p in params
            ],
            "trainers": trainers,
            "sync_mode": sync_mode,
            "optimizer": optimizer.to_dict(),
            "max_staleness": config.max_staleness,
            "tables": [t.to_dict() for t in tables],
            # Only when set, so the digests of jobs (and checkpoints) from before a field stay as they were.
            **({"k_steps": config.k_steps} if config.k_steps else {}),
            **({"backup_trainers": config.backup_trainers} if config.backup_trainers else {}),
            **({"layout_epoch": layout_epoch} if layout_epoch else {}),
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
