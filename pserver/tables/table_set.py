"""TableSet: one pserver's shard of every distributed table, as the wire sees them.

A push or prefetch names a table's tensors ``"<table>@ids"`` (int64 ``[n]``)
and ``"<table>@rows"`` (``[n, dim]``). The set says what such names must hold
(:meth:`expect`), pairs and checks what arrived (:meth:`sparse_grads`), and
applies gradients with each table's optimizer and learning-rate schedule.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

import numpy as np
import torch

from transpiler import PserverProgram
from transpiler.optim import LrSchedule
from transpiler.tables import SPARSE_SEPARATOR, TableSpec

from ..errors import BadRequest
from .files import saved_shards, shard_directory
from .shard import TableShard

log = logging.getLogger(__name__)

# (unique ids, gradient rows) of one table.
SparseGrad = Tuple[np.ndarray, torch.Tensor]


@dataclass(frozen=True)
class TableStats:
    """One table shard's rows and lifecycle counts, for ps-stat and /metrics (fields as ps.proto's)."""

    table: str
    rows: int
    disk_rows: int
    disk_bytes: int
    admitted: int
    refused: int
    evicted: int
    spilled: int
    promoted: int
    bytes: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class TableSet:
    """The table shards of one pserver, keyed by table name.

    ``tables_from``: a directory written by :meth:`save` (of a run with any
    number of pservers) to start from instead of initial rows.
    """

    def __init__(self, program: PserverProgram, tables_from: Optional[str] = None):
        self.endpoint = program.endpoint
        self.shard = program.shard
        self.n_shards = len(program.pservers)
        self.disk_dir = program.config.table_disk_dir
        self.specs: Dict[str, TableSpec] = {t.name: t for t in program.tables}
        if tables_from is None:
            self.shards = {
                name: TableShard(spec, self.shard, self.n_shards, self.disk_dir)
                for name, spec in self.specs.items()
            }
        else:
            self.shards = self.load_shards({name: saved_shards(tables_from, name) for name in self.specs})
            log.info("%s: %d tables loaded from %s", self.endpoint, len(self.shards), tables_from)
        self.schedules = {name: LrSchedule(spec.optimizer) for name, spec in self.specs.items()}
        self._wire = {}
        for spec in self.specs.values():
            self._wire[spec.ids_name] = ("int64", [-1])
            self._wire[spec.rows_name] = (spec.dtype, [-1, spec.dim])
            self._wire[spec.next_name] = ("int64", [-1])

    def __bool__(self) -> bool:
        return bool(self.specs)

    def expect(self, name: str) -> Optional[Tuple[str, List[int]]]:
        """(dtype, shape with free dim 0) of a sparse wire tensor, None if not a table's."""
        return self._wire.get(name)

    def _paired(self, tensors: Mapping[str, torch.Tensor], part: str) -> Dict[str, torch.Tensor]:
        """``{table: tensor}`` of the ``<table>@<part>`` tensors among ``tensors``."""
        suffix = SPARSE_SEPARATOR + part
        return {n[: -len(suffix)]: t for n, t in tensors.items() if n.endswith(suffix) and n in self._wire}

    def requested_ids(self, tensors: Mapping[str, torch.Tensor], part: str = "ids") -> Dict[str, np.ndarray]:
        """``{table: ids}`` of the ``<table>@<part>`` tensors, each checked to belong to this shard.

        A prefetch carries nothing else (else :class:`BadRequest`); a PushPull's
        ``@next`` ids ask for rows as of after its push.
        """
        if part == "ids":
            extra = sorted(n for n in tensors if not n.endswith(SPARSE_SEPARATOR + "ids"))
            if extra:
                raise BadRequest(
                    f"a prefetch carries only '<table>{SPARSE_SEPARATOR}ids' tensors, got {extra[:3]}"
                )
        out = {}
        for name, ids in self._paired(tensors, part).items():
            ids = ids.numpy()
            self.shards[name].check_ids(ids)
            out[name] = ids
        return out

    def sparse_grads(self, tensors: Mapping[str, torch.Tensor]) -> Dict[str, SparseGrad]:
        """``{table: (ids, rows)}`` from a push's sparse tensors, checked.

        Ids and rows must come in pairs of equal length, and every id must
        belong to this shard (else :class:`BadRequest`). Duplicate ids are summed.
        """
        ids, rows = self._paired(tensors, "ids"), self._paired(tensors, "rows")
        if ids.keys() != rows.keys():
            lone = sorted(ids.keys() ^ rows.keys())
            raise BadRequest(
                f"table {lone[0]!r}: a sparse gradient needs both '{lone[0]}@ids' and '{lone[0]}@rows'"
            )
        out = {}
        for name in ids:
            table_ids, table_rows = ids[name].numpy(), rows[name]
            if len(table_ids) != len(table_rows):
                raise BadRequest(f"table {name!r}: {len(table_ids)} ids but {len(table_rows)} gradient rows")
            out[name] = self.shards[name].merged_gradient(table_ids, table_rows)
        return out

    def lookup(self, ids: Mapping[str, np.ndarray]) -> List[Tuple[str, torch.Tensor]]:
        """``[("<table>@rows", rows)]`` for the ids asked of each table, in request order."""
        return [
            (self.specs[name].rows_name, torch.from_numpy(self.shards[name].lookup(table_ids)))
            for name, table_ids in ids.items()
        ]

    def apply(self, grads: Mapping[str, SparseGrad], step: int) -> None:
        """One optimizer step per table in ``grads``, with the table's lr of ``step``."""
        for name, (ids, rows) in grads.items():
            self.shards[name].apply(ids, rows, self.schedules[name].lr_at(step))

    def add(self, deltas: Mapping[str, SparseGrad], scale: float) -> None:
        """GEO: add the pushed rows' ``deltas`` ({table: (ids, rows)}) times ``scale``."""
        for name, (ids, rows) in deltas.items():
            # GEO tables train with sgd (the transpiler refuses others): its ``row += (-lr) * pushed`` with
            # lr = -scale is ``row += scale * delta``, through the shard's one update path (admission, tiers).
            self.shards[name].apply(ids, rows, -scale)

    def load_shards(self, directories: Mapping[str, List[str]]) -> Dict[str, TableShard]:
        """This pserver's shard of each table rebuilt from saved shard ``directories`` ({table: dirs}).

        Changes nothing here; :meth:`install` puts them in place.
        """
        return {
            name: TableShard.load(
                self.specs[name], self.shard, self.n_shards, directories[name], self.disk_dir
            )
            for name in self.specs
        }

    def install(self, shards: Mapping[str, TableShard]) -> None:
        """Replace the table shards (after a checkpoint load); the old ones' disk tiers are removed."""
        for name, shard in shards.items():
            old = self.shards.get(name)
            shard.life.track_tombstones(old is not None and old.life.tracks_tombstones)
            if old is not None and old is not shard:
                old.close_disk()
        self.shards.update(shards)

    def close(self) -> None:
        """Remove the disk tiers' working stores (the pserver is stopping)."""
        for shard in self.shards.values():
            shard.close_disk()

    def save(self, root: str) -> List[str]:
        """Write every shard to ``root/<table>/shard-K-of-N``; returns those directories."""
        paths = []
        for name, shard in self.shards.items():
            path = shard_directory(root, name, self.shard, self.n_shards)
            shard.save(path)
            paths.append(path)
        return paths

    def stats(self) -> Tuple[TableStats, ...]:
        """Every table shard's rows and lifecycle counts, lock-free (read while training runs)."""
        out = []
        for name, shard in self.shards.items():
            c = shard.life.counts
            out.append(
                TableStats(
                    name,
                    shard.rows_held,
                    shard.disk_rows,
                    shard.disk_bytes,
                    c.admitted,
                    c.refused,
                    c.evicted,
                    c.spilled,
                    c.promoted,
                    shard.nbytes,
                )
            )
        return tuple(out)

    @property
    def rows(self) -> int:
        """Rows held by every shard, in memory and on disk."""
        return sum(s.rows_held for s in self.shards.values())

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards.values())

    def names(self) -> Iterable[str]:
        return self.specs.keys()
