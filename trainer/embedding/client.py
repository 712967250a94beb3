"""TableClient: a trainer's side of every distributed table (dedupe, route, prefetch cache, gradients)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from transpiler.tables import SPARSE_SEPARATOR, TableSpec, as_ids, merge_duplicates

from ..errors import PserverError
from ..transport import TensorsByPserver
from .id_kernels import route as _route
from .id_kernels import unique_inverse
from .touched import TouchedRows

log = logging.getLogger(__name__)

# Dedupes remembered at most (the latest ones).
_DEDUPE_MEMO = 8

# {rows wire name: (dtype, shape)}: the rows an answer brings.
RowShapes = Dict[str, Tuple[str, List[int]]]
# Per pserver endpoint: {rows wire name: rows}.
RowsByPserver = Dict[str, Dict[str, torch.Tensor]]


@dataclass(frozen=True)
class RowFetch:
    """Table ids asked of each pserver, and the rows each answer brings back."""

    ids: TensorsByPserver  # per pserver: [("<table>@ids" or "<table>@next", ids)]
    rows: Dict[str, RowShapes]  # per pserver: the rows its answer holds

    def zero_rows(self) -> RowsByPserver:
        """Zero rows in the shape of the answers: what a batch whose lookup failed computes with."""
        return {
            ep: {
                name: torch.zeros(shape, dtype=getattr(torch, dtype)) for name, (dtype, shape) in rows.items()
            }
            for ep, rows in self.rows.items()
        }


# (a RowFetch, min_step) -> the rows each pserver answered
Fetch = Callable[[RowFetch, int], RowsByPserver]


@dataclass
class NextBatchPlan:
    """The next batch's table ids, prepared while this one trains: dedupes, routes, and (async) rows
    fetched already."""

    # (ids as given, sorted unique ids, inverse) per table fed
    deduped: List[Tuple[object, np.ndarray, np.ndarray]] = field(default_factory=list)
    wanted: Dict[str, np.ndarray] = field(default_factory=dict)  # table -> sorted unique ids
    routes: Dict[str, Tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # table -> (order, bounds)
    rows: Optional[Dict[str, torch.Tensor]] = None  # table -> rows of ``wanted``, once known


def _dedupe_key(ids) -> Optional[tuple]:
    """What identifies a CPU ids tensor's contents for the rest of a step (memory, layout, in-place
    version)."""
    if isinstance(ids, torch.Tensor) and ids.device.type == "cpu":
        return (ids.data_ptr(), tuple(ids.shape), ids.stride(), ids.dtype, ids._version)
    return None


class TableClient:
    """A trainer's side of every distributed table: routing, prefetch cache, pending gradients.

    ``fetch`` performs one prefetch round trip per pserver of a
    :class:`RowFetch` (the trainer's stepper, which heals a failure).
    ``min_step`` returns the pserver updates a read must wait for (sync:
    the current step; async: 0). ``touched`` (GEO mode): the rows trained on
    this trainer since its last sync; lookups read them there and keep the
    others they fetch there.
    """

    def __init__(
        self,
        tables: Sequence[TableSpec],
        pservers: Sequence[str],
        fetch: Fetch,
        min_step: Callable[[], int],
        touched: Optional[TouchedRows] = None,
    ):
        self.specs: Dict[str, TableSpec] = {t.name: t for t in tables}
        self.touched = touched
        self.pservers = list(pservers)
        self._fetch = fetch
        self._min_step = min_step
        self._cache: Dict[str, Tuple[np.ndarray, torch.Tensor]] = {}
        self._lookups: Dict[str, List[Tuple[np.ndarray, torch.Tensor]]] = {}
        # This step's dedupes by ids tensor: a prefetch and the lookups after it, or
        # several tables fed the same ids, sort them once. Keyed by the tensor's
        # memory and in-place version; the tensor is kept so its memory stays its own.
        self._deduped: Dict[tuple, Tuple[torch.Tensor, np.ndarray, np.ndarray]] = {}
        # This step's routes by unique-ids array (kept alive with them): a prefetch,
        # several tables fed the same ids, and the step's push hash them once.
        self._routes: Dict[int, Tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        # The next batch's ids sent with this step's push (ask_next_batch), until their rows come back.
        self._next_batch: Optional[NextBatchPlan] = None
        self._on_moved: Optional[Callable[[PserverError], None]] = None

    def follow_moves(self, on_moved: Callable[[PserverError], None]) -> None:
        """A lookup answered "moved" (the job changed its pserver count) calls ``on_moved`` with the answer:
        the trainer adopts the layout it names and serves the tables from the client of that layout."""
        self._on_moved = on_moved

    def moved(self, error: PserverError) -> None:
        """A lookup through this client was answered "moved" (``error``): hand it to the trainer to adopt
        the layout it names (:meth:`follow_moves`), or raise it if nobody follows."""
        if self._on_moved is None:
            raise error
        self._on_moved(error)

    def carry_lookups(self, previous: "TableClient") -> None:
        """Take over the lookups of this step ``previous`` (the client of the layout before) recorded: their
        gradients are pushed from here."""
        self._lookups = previous.take_lookups()

    def take_lookups(self) -> Dict[str, List[Tuple[np.ndarray, torch.Tensor]]]:
        """This step's lookups ({table: [(unique ids, leaf rows)]}), forgotten here."""
        lookups, self._lookups = self._lookups, {}
        return lookups

    def spec(self, table: str) -> TableSpec:
        spec = self.specs.get(table)
        if spec is None:
            raise KeyError(f"{table!r} is not a distributed table; tables: {sorted(self.specs)}")
        return spec

    # -- reads ----------------------------------------------------------------

    def dedupe(self, ids) -> Tuple[np.ndarray, np.ndarray]:
        """(sorted unique ids, inverse) of ``ids``: ``unique[inverse] == ids.ravel()``.

        Remembered for the rest of the step for a CPU tensor, so the same
        ids are sorted once however many tables and lookups use them.
        """
        key = _dedupe_key(ids)
        if key is not None:
            hit = self._deduped.get(key)
            if hit is not None:
                return hit[1], hit[2]
        unique, inverse = unique_inverse(as_ids(ids))
        if key is not None:
            if len(self._deduped) >= _DEDUPE_MEMO:  # lookups without steps (evaluation) stay bounded
                del self._deduped[next(iter(self._deduped))]
            self._deduped[key] = (ids, unique, inverse)
        return unique, inverse

    def _route(self, ids: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(order, bounds) of :func:`_route`, remembered for the rest of the step by array, like
        :meth:`dedupe`."""
        hit = self._routes.get(id(ids))
        if hit is not None and hit[0] is ids:
            return hit[1], hit[2]
        order, bounds = _route(ids, len(self.pservers))
        if len(self._routes) >= _DEDUPE_MEMO:
            del self._routes[next(iter(self._routes))]
        self._routes[id(ids)] = (ids, order, bounds)
        return order, bounds

    def _row_fetch(
        self, wanted: Mapping[str, np.ndarray], routes: Mapping[str, tuple], part: str
    ) -> RowFetch:
        """``wanted`` ({table: unique ids}) as ``"<table>@<part>"`` tensors per pserver, cut along
        ``routes``."""
        ids: TensorsByPserver = {}
        for table, (order, bounds) in routes.items():
            table_ids = wanted[table]
            name = f"{table}{SPARSE_SEPARATOR}{part}"
            for k, ep in enumerate(self.pservers):
                if bounds[k + 1] > bounds[k]:
                    ids.setdefault(ep, []).append(
                        (name, torch.from_numpy(table_ids[order[bounds[k] : bounds[k + 1]]]))
                    )
        return RowFetch(ids, {ep: self.row_shapes(asked) for ep, asked in ids.items()})

    def row_shapes(self, asked: Sequence[Tuple[str, torch.Tensor]]) -> RowShapes:
        """The rows an answer to ``asked`` ((``@ids``/``@next`` name, ids) pairs) brings back."""
        shapes = {}
        for name, ids in asked:
            spec = self.spec(name.rpartition(SPARSE_SEPARATOR)[0])
            shapes[spec.rows_name] = (spec.dtype, [len(ids), spec.dim])
        return shapes

    def _assemble(
        self,
        wanted: Mapping[str, np.ndarray],
        routes: Mapping[str, tuple],
        replies: Mapping[str, Mapping[str, torch.Tensor]],
    ) -> Dict[str, torch.Tensor]:
        """``{table: rows}`` in the order of ``wanted``'s ids, from each pserver's rows."""
        out = {}
        for table, ids in wanted.items():
            spec = self.specs[table]
            rows = torch.empty((ids.size, spec.dim), dtype=getattr(torch, spec.dtype))
            if table in routes:
                order, bounds = routes[table]
                for k, ep in enumerate(self.pservers):
                    if bounds[k + 1] > bounds[k]:
                        # index_copy_, not indexed assignment: the same rows, a fifth of the CPU
                        at = torch.from_numpy(order[bounds[k] : bounds[k + 1]])
                        rows.index_copy_(0, at, replies[ep][spec.rows_name])
            out[table] = rows
        return out

    def fetch(self, wanted: Mapping[str, np.ndarray]) -> Dict[str, torch.Tensor]:
        """Rows of ``wanted`` ({table: unique ids}) from the pservers, one round trip per pserver.

        Returns ``{table: rows}`` with rows in the order of the ids given.
        """
        routes = {table: self._route(ids) for table, ids in wanted.items() if ids.size}
        request = self._row_fetch(wanted, routes, "ids")
        replies = self._fetch(request, self._min_step()) if request.ids else {}
        return self._assemble(wanted, routes, replies)

    def prefetch(self, ids: Mapping[str, object]) -> None:
        """Fetch the rows of several tables' ids at once, for this step's lookups to use.

        Tables whose rows for exactly these ids already came (with the last
        step's answer, see :meth:`ask_next_batch`) are not asked again.
        """
        wanted = {}
        for table, table_ids in ids.items():
            self.spec(table)
            unique = self.dedupe(table_ids)[0]
            cached = self._cache.get(table)
            if cached is None or cached[0] is not unique:
                wanted[table] = unique
        for table, rows in self.fetch(wanted).items():
            self._cache[table] = (wanted[table], rows)

    def plan_next_batch(
        self, ids: Mapping[str, object], fetched_for: Optional[Fetch] = None
    ) -> NextBatchPlan:
        """The next batch's ids ({table: ids}) deduplicated and routed, ready for :meth:`ask_next_batch`.

        Touches no state of this client, so the trainer's pipeline runs it on
        a background thread while the current batch trains. With
        ``fetched_for`` (a fetch callable, async mode) the rows are fetched
        now as well, as of the pservers' latest updates; a fetch that fails
        leaves them to the lookups, which fetch (and heal) for themselves.
        """
        plan = NextBatchPlan()
        for table, table_ids in ids.items():
            self.spec(table)
            unique, inverse = unique_inverse(as_ids(table_ids))
            plan.deduped.append((table_ids, unique, inverse))
            plan.wanted[table] = unique
            if unique.size:
                plan.routes[table] = _route(unique, len(self.pservers))
        if fetched_for is not None:
            request = self._row_fetch(plan.wanted, plan.routes, "ids")
            try:
                replies = fetched_for(request, 0) if request.ids else {}
                plan.rows = self._assemble(plan.wanted, plan.routes, replies)
            except PserverError as e:
                log.info("rows of the next batch were not fetched ahead (%s); its lookups fetch them", e)
        return plan

    def ask_next_batch(self, plan: NextBatchPlan) -> RowFetch:
        """The planned ids as ``<table>@next`` push tensors per pserver, and the rows each answer holds.

        Call after this step's gradients were taken: the answer to the push
        brings the rows back as of after it (:meth:`take_next_batch_rows`
        caches them), saving the next step's Prefetch round trip.
        """
        self._next_batch = plan
        return self._row_fetch(plan.wanted, plan.routes, "next")

    def take_next_batch_rows(self, replies: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Cache the rows the push answers brought for :meth:`ask_next_batch`'s ids, for the next step's
        lookups."""
        plan, self._next_batch = self._next_batch, None
        plan.rows = self._assemble(plan.wanted, plan.routes, replies)
        self.install_next_batch(plan)

    def install_next_batch(self, plan: NextBatchPlan) -> None:
        """Make ``plan``'s work this step's: its dedupes and routes, and its rows when it holds them."""
        for ids, unique, inverse in plan.deduped:
            key = _dedupe_key(ids)
            if key is not None:
                self._deduped[key] = (ids, unique, inverse)
        for table, unique in plan.wanted.items():
            if table in plan.routes:
                self._routes[id(unique)] = (unique, *plan.routes[table])
            if plan.rows is not None:
                self._cache[table] = (unique, plan.rows[table])

    def rows(self, table: str, unique_ids: np.ndarray) -> torch.Tensor:
        """Rows of sorted unique ids (a new tensor): GEO's touched rows, then this step's prefetch where
        possible.

        A prefetch of exactly these ids (the same array) is handed over whole and forgotten, so no two
        lookups share a tensor of rows.
        """
        if self.touched is not None:
            hit, at = self.touched.find(table, unique_ids)
            if hit.any():
                if hit.all():
                    return self.touched.rows(table, at)
                rows = self._rows_from_pservers(table, unique_ids[~hit])
                out = torch.empty((unique_ids.size, rows.shape[1]), dtype=rows.dtype)
                out[torch.from_numpy(hit)] = self.touched.rows(table, at[hit])
                out[torch.from_numpy(~hit)] = rows
                return out
        return self._rows_from_pservers(table, unique_ids)

    def _rows_from_pservers(self, table: str, unique_ids: np.ndarray) -> torch.Tensor:
        """Rows of sorted unique ids as the pservers hold them: this step's prefetch, fetching the others."""
        cached = self._cache.get(table)
        if cached is None:
            return self.fetch({table: unique_ids})[table]
        cached_ids, cached_rows = cached
        if cached_ids is unique_ids:
            del self._cache[table]
            return cached_rows
        pos = np.minimum(np.searchsorted(cached_ids, unique_ids), max(cached_ids.size - 1, 0))
        hit = cached_ids[pos] == unique_ids if cached_ids.size else np.zeros(unique_ids.size, bool)
        if hit.all():
            return cached_rows[torch.from_numpy(pos)]
        rows = torch.empty((unique_ids.size, cached_rows.shape[1]), dtype=cached_rows.dtype)
        rows[torch.from_numpy(hit)] = cached_rows[torch.from_numpy(pos[hit])]
        rows[torch.from_numpy(~hit)] = self.fetch({table: unique_ids[~hit]})[table]
        return rows

    def pull_rows(self, table: str, ids) -> torch.Tensor:
        """Current rows of ``ids`` (any shape, repeats allowed): ``ids.shape + (dim,)``."""
        spec = self.spec(table)
        unique, inverse = self.dedupe(ids)
        rows = self.fetch({table: unique})[table][torch.from_numpy(inverse)]
        shape = tuple(ids.shape) if hasattr(ids, "shape") else (inverse.size,)
        return rows.reshape(shape + (spec.dim,))

    # -- gradients --------------------------------------------------------------

    def record(self, table: str, unique_ids: np.ndarray, leaf: torch.Tensor) -> None:
        """Remember a lookup's leaf rows; their gradient is pushed at the next step (GEO: trained here).

        GEO keeps the rows fetched for ids it did not hold yet as they came (before backward).
        """
        self._lookups.setdefault(table, []).append((unique_ids, leaf))
        if self.touched is not None:
            self.touched.add(table, unique_ids, leaf, self.specs[table].padding_idx)

    def take_gradients(self) -> TensorsByPserver:
        """This step's sparse gradients as push tensors per pserver; clears lookups and cache.

        A table whose lookups got a gradient is sent to every pserver, with no
        rows where none of its ids live: the pserver then still counts the
        table's optimizer step, as torch counts a step of a weight with a
        gradient.
        """
        # Routed before the step is cleared: the lookups' routes of the same ids are reused.
        grads = self.route_gradients(self.take_table_gradients(clear=False))
        self.clear()
        return grads

    def take_table_gradients(self, clear: bool = True) -> Dict[str, Tuple[np.ndarray, torch.Tensor]]:
        """This step's gradient of each table with one: (unique ids, rows on the CPU); clears the step.

        Padding ids are left out (their rows never train).
        """
        out = {}
        for table, lookups in self._lookups.items():
            spec = self.specs[table]
            with_grad = [(ids, leaf.grad) for ids, leaf in lookups if leaf.grad is not None]
            if not with_grad:
                continue
            if len(with_grad) == 1:  # one lookup: its ids are unique already
                ids, grads = with_grad[0][0], with_grad[0][1].to("cpu")
            else:
                ids, grads = merge_duplicates(
                    np.concatenate([ids for ids, _ in with_grad]),
                    torch.cat([g.to("cpu") for _, g in with_grad]),
                )
            if spec.padding_idx is not None:
                keep = ids != spec.padding_idx
                if not keep.all():
                    ids, grads = ids[keep], grads[torch.from_numpy(keep)]
            out[table] = (ids, grads)
        if clear:
            self.clear()
        return out

    def route_gradients(self, grads: Mapping[str, Tuple[np.ndarray, torch.Tensor]]) -> TensorsByPserver:
        """Table gradients ({table: (unique ids, rows)}) as push tensors per pserver (every pserver)."""
        by_pserver: TensorsByPserver = {ep: [] for ep in self.pservers}
        for table, (ids, rows) in grads.items():
            spec = self.specs[table]
            order, bounds = self._route(ids)
            order_t = torch.from_numpy(order)
            ids, rows = ids[order], rows.index_select(0, order_t)  # a fifth of rows[order_t]'s CPU
            for k, ep in enumerate(self.pservers):
                lo, hi = int(bounds[k]), int(bounds[k + 1])
                by_pserver[ep] += [
                    (spec.ids_name, torch.from_numpy(ids[lo:hi])),
                    (spec.rows_name, rows[lo:hi]),
                ]
        return by_pserver

    def clear(self) -> None:
        """Forget this step's lookups, prefetched rows and dedupes."""
        self._lookups = {}
        self._cache = {}
        self._deduped = {}
        self._routes = {}
