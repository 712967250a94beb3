"""How a distributed table bounds itself over a long run: admission, eviction, disk tier.

Every policy is off by default (rows are then created on their first update
and kept forever). The exact rules, which the pservers apply and a
single-process reference can repeat (docs/tables.md, "Table lifecycle"):

- The table's **step** counts its optimizer steps: one per applied step in
  sync mode (all trainers' gradients merged), one per applied push in async
  mode. Every shard of a table counts the same steps.
- **Admission.** An id that holds no row is *pending*. Its count is the number
  of steps in which it had a gradient while pending (halved, rounding down,
  at the end of every ``admit_decay_steps``-th step when that is set). It is
  admitted in the step its count reaches ``admit_count`` and that step's
  gradient is applied to its initial row. With ``admit_probability`` below 1
  an id is admissible only if ``u(table seed, id) < admit_probability``
  (``u`` a fixed hash to [0, 1)): a pure function of the id, so the same ids
  are admitted on any number of pservers in any order. Until admitted, a
  lookup gives the id's initial row and its gradients are dropped. Counts
  live in a count-min sketch of ``admit_sketch_width`` x 4 counters per
  shard (bounded memory; a collision can only admit an id early).
- **Eviction** runs at the end of every ``sweep_every_steps``-th step (and so
  at step boundaries in sync mode). A row is removed if it was not updated in
  the last ``evict_unseen_steps`` steps (its last update at step ``l``, the
  sweep at step ``s``: ``s - l >= evict_unseen_steps``); or not updated for
  ``evict_unseen_seconds`` of wall-clock time; or its score is below
  ``evict_score_below``. A row's score is a decayed count of the steps that
  updated it: ``score = score * score_decay ** (s - l) + 1`` at an update at
  step ``s`` after one at ``l``, and ``score * score_decay ** (s - l)`` at a
  sweep. With ``max_rows``, a shard holding more than its share of rows
  (``ceil(max_rows / n_shards)``) at the end of a step evicts its
  lowest-ranked rows (lowest score, then least recently updated, then
  smallest id) until it holds 90% of its share. An evicted id is pending
  again: its count is what it was when it was admitted, so it is readmitted
  at its next gradient (unless decay brought the count down), and it starts
  again from its initial row and fresh optimizer state.
- **Disk tier.** With ``ram_rows``, a shard keeps at most its share of that many
  rows in memory at the end of each step and moves the least recently updated
  rows (with their optimizer state and metadata) to a store on local disk;
  any access brings a row back. Results equal the all-in-RAM table.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Mapping, Union

MAX_ADMIT_COUNT = 65535  # counters are uint16 (saturating)
BUDGET_LOW_WATER = 0.9  # a full row budget evicts down to this fraction of it


@dataclass
class TableLifecycle:
    """Admission, eviction and disk-tier policy of one distributed table; all off by default.

    Fields (type and default are the dataclass's own; ``python -m transpiler
    config-reference`` renders them with these meanings in docs/configuration.md):

    - ``admit_count``: steps with a gradient an id needs before it gets a row
      (1: every id at once).
    - ``admit_probability``: fraction of ids ever admitted, decided by a hash of
      (table seed, id).
    - ``admit_sketch_width``: counters per row of the 4-row count-min sketch that
      counts pending ids on each shard (a power of two; 2 bytes each: 8 MiB per
      shard by default).
    - ``admit_decay_steps``: halve every pending count at the end of every
      this-many-th step; 0: never.
    - ``evict_unseen_steps``: evict rows not updated for this many steps; 0: off.
    - ``evict_unseen_seconds``: evict rows not updated for this many seconds of wall-clock
      time; 0: off.
    - ``evict_score_below``: evict rows whose decayed score is below this; 0: off.
    - ``score_decay``: per-step decay of a row's score, in (0, 1].
    - ``max_rows``: row budget of the whole table, split evenly over the
      pservers; 0: none.
    - ``sweep_every_steps``: eviction sweeps run at the end of every this-many-th
      step.
    - ``ram_rows``: rows of the whole table kept in memory; the rest go to the
      disk tier (the pserver's ``table_disk_dir``); 0: every row in memory.
    """

    admit_count: int = 1
    admit_probability: float = 1.0
    admit_sketch_width: int = 1 << 20
    admit_decay_steps: int = 0
    evict_unseen_steps: int = 0
    evict_unseen_seconds: float = 0.0
    evict_score_below: float = 0.0
    score_decay: float = 1.0
    max_rows: int = 0
    sweep_every_steps: int = 1
    ram_rows: int = 0

    @property
    def admits_all(self) -> bool:
        """Every id gets a row on its first gradient (today's behaviour)."""
        return self.admit_count == 1 and self.admit_probability >= 1.0

    @property
    def sweeps(self) -> bool:
        """Some eviction rule needs periodic sweeps."""
        return bool(self.evict_unseen_steps or self.evict_unseen_seconds or self.evict_score_below)

    @property
    def scores(self) -> bool:
        """Rows keep a decayed score (for the score rule or the row budget)."""
        return bool(self.evict_score_below or self.max_rows)

    def shard_share(self, total: int, n_shards: int) -> int:
        """A shard's share of a whole-table row count: ``ceil(total / n_shards)``."""
        return -(-int(total) // n_shards)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_INTS = (
    "admit_count",
    "admit_sketch_width",
    "admit_decay_steps",
    "evict_unseen_steps",
    "max_rows",
    "sweep_every_steps",
    "ram_rows",
)


def table_lifecycle(value: Union[None, TableLifecycle, Mapping[str, object]], table: str) -> TableLifecycle:
    """``value`` (None, a :class:`TableLifecycle` or a dict of its fields) checked for table ``table``.

    Unknown fields, wrong types, out-of-range values and contradictory settings
    raise ValueError naming the table and the field, before anything starts.
    """
    if value is None:
        return TableLifecycle()
    if isinstance(value, Mapping):
        known = {f.name for f in dataclasses.fields(TableLifecycle)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"distributed table {table!r}: unknown lifecycle settings {unknown}; known: {sorted(known)}"
            )
        value = TableLifecycle(**value)
    if not isinstance(value, TableLifecycle):
        raise TypeError(
            f"distributed table {table!r}: lifecycle must be a TableLifecycle or a dict, "
            f"got {type(value).__name__}"
        )
    _check(value, table)
    return value


def _check(lc: TableLifecycle, table: str) -> None:
    def bad(name, why):
        raise ValueError(f"distributed table {table!r}: lifecycle {name}={getattr(lc, name)!r} {why}")

    for name in _INTS:
        v = getattr(lc, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            bad(name, "must be an int >= 0")
    for name in ("admit_probability", "evict_unseen_seconds", "evict_score_below", "score_decay"):
        v = getattr(lc, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            bad(name, "must be a finite number >= 0")
    if not 1 <= lc.admit_count <= MAX_ADMIT_COUNT:
        bad("admit_count", f"must be in [1, {MAX_ADMIT_COUNT}]")
    if not 0 < lc.admit_probability <= 1:
        bad("admit_probability", "must be in (0, 1]: 0 would admit no id at all")
    if lc.admit_sketch_width < 64 or lc.admit_sketch_width & (lc.admit_sketch_width - 1):
        bad("admit_sketch_width", "must be a power of two >= 64")
    if lc.admit_decay_steps and lc.admit_count == 1:
        bad("admit_decay_steps", "needs admit_count > 1: with 1 every id is admitted at once")
    if not 0 < lc.score_decay <= 1:
        bad("score_decay", "must be in (0, 1]")
    if lc.score_decay < 1 and not lc.scores:
        bad("score_decay", "has no effect without evict_score_below or max_rows")
    if lc.evict_score_below and lc.score_decay == 1 and lc.evict_score_below <= 1:
        bad("evict_score_below", "can never evict: without score_decay < 1 a row's score is at least 1")
    if lc.sweep_every_steps < 1:
        bad("sweep_every_steps", "must be >= 1")
    if lc.sweep_every_steps > 1 and not lc.sweeps:
        bad("sweep_every_steps", "has no effect without an evict_* rule")
    if lc.ram_rows and lc.max_rows:
        bad(
            "ram_rows",
            f"cannot be combined with max_rows={lc.max_rows} (yet): the row budget would "
            f"rank the rows on disk too; bound the table with an evict_* rule instead",
        )
