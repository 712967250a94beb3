"""What a pserver holds, as requests name it: its blocks and its table shards' wire tensors.

:class:`Contents` says which tensors a push, pull or prefetch may carry, with
which dtype and shape, and how a received push splits into dense gradients,
sparse gradients and the ids whose rows its answer carries. The servicer holds
one (built by the server over the same blocks and tables as the engine) and
asks it instead of reaching into the block store or the table set; the engine
is told only what to count and apply.

None of it takes the engine's lock: names, dtypes and shapes come from the
plan and never change while the pserver runs, and the id checks read only
each table's sharding.
"""

from __future__ import annotations

import functools
from typing import AbstractSet, Dict, List, Mapping, NamedTuple, Optional, Tuple

import numpy as np
import torch

from psproto.dtypes import DTYPES

from ..store import BlockStore
from ..tables import SparseGrad, TableSet

# (dtype name, shape) a received tensor must have; a dim 0 of -1 accepts any row count.
Expected = Tuple[str, List[int]]


class PushParts(NamedTuple):
    """A received push, split by what each tensor is (see :meth:`Contents.sort_push`)."""

    dense: Dict[str, torch.Tensor]  # {block: gradient}
    sparse: Dict[str, SparseGrad]  # {table: (unique ids, summed gradient rows)}
    answer_ids: Dict[str, np.ndarray]  # {table: ids whose rows the answer carries, as of after the push}


class Contents:
    """Names, dtypes and shapes of this pserver's blocks and table tensors; splitting what a push carries."""

    def __init__(self, store: BlockStore, tables: TableSet):
        self.store = store
        self.tables = tables

    def block_names(self) -> AbstractSet[str]:
        """The dense blocks this pserver owns: a read-only set view, in plan order.

        What a Pull may name (all of them when it names none), and which of a
        push's tensors are dense gradients.
        """
        return self.store.names()

    def block_layout(self) -> Dict[str, Tuple[torch.dtype, List[int]]]:
        """Each dense block's torch dtype and shape: what a buffer receiving its gradient must be."""
        return {name: (DTYPES[spec.dtype], spec.shape) for name, spec in self.store.specs.items()}

    def block_nbytes(self) -> Dict[str, int]:
        """Each dense block's bytes, in plan order: what :mod:`psproto.lane_blocks` deals blocks to lanes
        by."""
        return {name: spec.nbytes for name, spec in self.store.specs.items()}

    def expect(self, name: str) -> Optional[Expected]:
        """(dtype name, shape) a push's tensor ``name`` must have; None for a name this pserver does not hold.

        A dense block's gradient has the block's shape; a table's wire tensors
        (``<table>@ids``, ``@rows``, ``@next``) have a free dim 0 (-1).
        """
        return self.store.expect(name) or self.tables.expect(name)

    def expect_table(self, name: str) -> Optional[Expected]:
        """(dtype name, shape with a free dim 0) of a table's wire tensor ``name``; None for any other name.

        What a prefetch may carry: a dense block's name in one is unknown there.
        """
        return self.tables.expect(name)

    @functools.cached_property
    def _block_bytes(self) -> int:
        # Every answer carries every block: their size, from the plan, is summed once, not per push.
        return sum(spec.nbytes for spec in self.store.specs.values())

    def answer_bytes(self, answer_ids: Mapping[str, np.ndarray]) -> int:
        """Tensor bytes a PushPull's answer carries: every block, then the rows of ``answer_ids`` ({table:
        ids}).

        Known before the push counts, so a call that can carry only so much (PushPullOne: one message) is
        refused before anything is applied.
        """
        return self._block_bytes + sum(
            len(ids) * self.tables.specs[table].row_bytes for table, ids in answer_ids.items()
        )

    def sort_push(self, tensors: Mapping[str, torch.Tensor]) -> PushParts:
        """A received push's tensors sorted: dense gradients, sparse gradients, ids whose rows its answer
        carries.

        Sparse ids and rows must come in pairs of equal length (duplicate ids are summed) and every id must
        belong to this shard, else :class:`~pserver.errors.BadRequest`; ``<table>@next`` ids ask a
        PushPull's answer for rows. Nothing is applied or counted here.
        """
        blocks = self.block_names()
        dense = {name: t for name, t in tensors.items() if name in blocks}
        if not self.tables:
            return PushParts(dense, {}, {})
        return PushParts(dense, self.tables.sparse_grads(tensors), self.tables.requested_ids(tensors, "next"))

    def prefetch_ids(self, tensors: Mapping[str, torch.Tensor]) -> Dict[str, np.ndarray]:
        """``{table: ids}`` a prefetch asks rows for, from its ``<table>@ids`` tensors.

        :class:`~pserver.errors.BadRequest` for any other tensor in it or an
        id that belongs to another shard.
        """
        return self.tables.requested_ids(tensors)
