"""Distributed tables: what a sparse embedding table is, where its ids live, how rows start.

A distributed table replaces an ``nn.Embedding`` / ``nn.EmbeddingBag`` of the
user's model. It lives only on the pservers, sharded by id: id ``i`` belongs to
the shard (the pserver at that position of the pserver list) that
:mod:`transpiler.layout.routing` names. Ids are any int64; ``num_embeddings`` is only
a capacity hint.

A row that was never updated has its *initial value*, a pure function of
(table seed, id) computed by :func:`initial_rows`, so a run does not depend on
the number of pservers or on the order in which ids arrive. Ids are sorted by
:func:`radix_sort`, compiled on both sides.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Union

import numpy as np
import torch

from psproto.dtypes import TABLE_DTYPES

from .layout.routing import owner_of
from .lifecycle import TableLifecycle, table_lifecycle
from .optim import OptimizerSpec
from .placement import stable_hash_name
from .row_init import INIT_VERSIONS
from .row_init import initial_rows as initial_rows  # the definition, where every role has read it

# Sparse optimizers, with torch's semantics for sparse gradients: the class
# whose update a table applies, and the only keyword arguments it takes.
# "adam" is torch.optim.SparseAdam: torch.optim.Adam refuses sparse gradients.
TABLE_OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {}),
    "adagrad": (torch.optim.Adagrad, {}),
    "adam": (torch.optim.SparseAdam, {}),
}
_TABLE_OPTIMIZER_KWARGS = {
    "sgd": {"lr"},
    "adagrad": {"lr", "lr_decay", "initial_accumulator_value", "eps"},
    "adam": {"lr", "betas", "eps"},
}
# The table optimizer a dense optimizer implies, and which of its kwargs carry over.
_DERIVED = {
    "sgd": "sgd",
    "momentum": "sgd",
    "adagrad": "adagrad",
    "adam": "adam",
    "adamw": "adam",
}

ROW_INITS = {"normal": {"mean": 0.0, "std": 1.0}, "uniform": {"a": 0.0, "b": 1.0}, "zeros": {}}
BAG_MODES = ("sum", "mean", "max")

# Reserved in names: a sparse gradient travels as tensors "<table>@ids" and "<table>@rows".
SPARSE_SEPARATOR = "@"


class TableOptimizerSpec(OptimizerSpec):
    """A table's sparse optimizer: ``sgd``, ``adagrad`` or ``adam`` (SparseAdam semantics).

    Takes torch's keyword names and defaults (``lr``; adagrad ``lr_decay``,
    ``initial_accumulator_value``, ``eps``; adam ``betas``, ``eps``). Weight
    decay and momentum are refused, as torch refuses them for sparse gradients.
    """

    registry = TABLE_OPTIMIZERS
    what = "table optimizer"

    def _check_optimizer_kwargs(self, cls: type) -> None:
        allowed = _TABLE_OPTIMIZER_KWARGS[self.name]
        unknown = sorted(set(self.kwargs) - allowed)
        if unknown:
            raise ValueError(
                f"table optimizer {self.name!r} does not take {unknown}; it accepts "
                f"{sorted(allowed)} (sparse updates have no weight decay or momentum)"
            )

    @classmethod
    def derived_from(cls, dense: OptimizerSpec) -> "TableOptimizerSpec":
        """The table optimizer a program's dense optimizer implies, with its schedule.

        sgd/momentum -> sgd, adagrad -> adagrad, adam/adamw -> adam (SparseAdam);
        only the keyword arguments the sparse form takes carry over.
        """
        name = _DERIVED.get(dense.name)
        if name is None:
            raise ValueError(
                f"optimizer {dense.name!r} has no sparse form for distributed tables; "
                f"give the table an optimizer: one of {sorted(TABLE_OPTIMIZERS)}"
            )
        kwargs = {k: v for k, v in dense.kwargs.items() if k in _TABLE_OPTIMIZER_KWARGS[name]}
        return cls(name, kwargs, dense.lr_scheduler, dict(dense.lr_scheduler_kwargs))


@dataclass
class TableOptions:
    """How a distributed table is trained and initialised (all optional).

    - ``optimizer`` (str or None, None): "sgd", "adagrad" or "adam"; None takes
      the sparse form of the program's optimizer (see
      :meth:`TableOptimizerSpec.derived_from`). ``optimizer_kwargs``: its
      keyword arguments; the program's lr schedule applies to it as well.
    - ``init`` (str, "normal"): initial rows, as ``torch.nn.init``'s
      ``normal_`` (``mean``, ``std``), ``uniform_`` (``a``, ``b``) or
      ``zeros_``, with ``init_kwargs``. "normal" with std 1 is what
      ``nn.Embedding`` itself does.
    - ``seed`` (int or None, None): seed of the initial rows; None derives it
      from the table name, so every role agrees without configuration.
    - ``init_version`` (int, 2): the definition of ``normal`` initial rows
      (:mod:`transpiler.row_init`): 2 computes them without libm calls; 1 is the
      definition of plans, checkpoints and exports from before version 2 (give
      it to continue such a job with the rows it started from).
    - ``lifecycle`` (:class:`~transpiler.lifecycle.TableLifecycle` or a dict of
      its fields, all off): admission, eviction and the disk tier.
    """

    optimizer: Optional[str] = None
    optimizer_kwargs: Dict[str, object] = field(default_factory=dict)
    init: str = "normal"
    init_kwargs: Dict[str, float] = field(default_factory=dict)
    seed: Optional[int] = None
    lifecycle: Union[TableLifecycle, Mapping[str, object], None] = None
    init_version: int = 2


@dataclass
class TableSpec:
    """A distributed table in a plan: shape, lookup kind, initial rows, optimizer.

    ``kind`` is "embedding" or "bag" (``nn.EmbeddingBag``, pooled by ``mode``);
    ``capacity`` is the module's ``num_embeddings``, a sizing hint only;
    ``padding_idx`` rows are zero and never trained, as in torch;
    ``lifecycle`` bounds the table (admission, eviction, disk tier);
    ``init_version`` is the definition of its initial rows (:mod:`transpiler.row_init`):
    2 in new plans, 1 where a plan, shard file or export has no such field.
    """

    name: str
    dim: int
    dtype: str
    kind: str
    capacity: int
    seed: int
    init: str
    init_kwargs: Dict[str, float]
    optimizer: TableOptimizerSpec
    mode: str = ""
    padding_idx: Optional[int] = None
    include_last_offset: bool = False
    lifecycle: TableLifecycle = field(default_factory=TableLifecycle)
    init_version: int = 2

    @property
    def ids_name(self) -> str:
        """Wire name of this table's id tensors."""
        return f"{self.name}{SPARSE_SEPARATOR}ids"

    @property
    def rows_name(self) -> str:
        """Wire name of this table's row tensors (values or gradients)."""
        return f"{self.name}{SPARSE_SEPARATOR}rows"

    @property
    def next_name(self) -> str:
        """Wire name of ids a PushPull asks rows for, as of after the push (the next step's lookups)."""
        return f"{self.name}{SPARSE_SEPARATOR}next"

    @property
    def row_bytes(self) -> int:
        return self.dim * np.dtype(self.dtype).itemsize

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["optimizer"] = self.optimizer.to_dict()
        return d

    @classmethod
    def from_dict(cls, data: dict) -> "TableSpec":
        data = dict(data)
        data["optimizer"] = TableOptimizerSpec.from_dict(data["optimizer"])
        data["lifecycle"] = TableLifecycle(**data.get("lifecycle", {}))
        data.setdefault("init_version", 1)  # written before versions: the first definition
        return cls(**data)


def table_spec(
    name: str, module: torch.nn.Module, options: TableOptions, dense_optimizer: OptimizerSpec
) -> TableSpec:
    """Describe ``module`` (an ``nn.Embedding`` or ``nn.EmbeddingBag``) as a distributed table.

    Raises ValueError for what a distributed table cannot do (``max_norm``,
    ``scale_grad_by_freq``, a non-float32/float64 weight) or bad options.
    """
    if SPARSE_SEPARATOR in name:
        raise ValueError(f"distributed table name {name!r} must not contain {SPARSE_SEPARATOR!r}")
    if isinstance(module, torch.nn.EmbeddingBag):
        kind, mode = "bag", module.mode
        if mode not in BAG_MODES:
            raise ValueError(
                f"distributed table {name!r}: EmbeddingBag mode {mode!r} is not one of {BAG_MODES}"
            )
    elif isinstance(module, torch.nn.Embedding):
        kind, mode = "embedding", ""
    else:
        raise ValueError(
            f"distributed table {name!r} is not an nn.Embedding or nn.EmbeddingBag module "
            f"of the model (it is {type(module).__name__})"
        )
    if module.max_norm is not None:
        raise ValueError(
            f"distributed table {name!r}: max_norm renormalises rows in place during "
            f"lookup, which a distributed table cannot do; remove it"
        )
    if module.scale_grad_by_freq:
        raise ValueError(
            f"distributed table {name!r}: scale_grad_by_freq depends on the local batch, "
            f"so sync training would differ from one process; remove it"
        )
    dtype = str(module.weight.dtype).replace("torch.", "")
    if dtype not in TABLE_DTYPES:
        raise ValueError(f"distributed table {name!r} has dtype {dtype}; tables hold {sorted(TABLE_DTYPES)}")
    if options.init not in ROW_INITS:
        raise ValueError(
            f"distributed table {name!r}: init {options.init!r} is not one of {sorted(ROW_INITS)}"
        )
    unknown = sorted(set(options.init_kwargs) - set(ROW_INITS[options.init]))
    if unknown:
        raise ValueError(
            f"distributed table {name!r}: init {options.init!r} does not take {unknown}; "
            f"it accepts {sorted(ROW_INITS[options.init])}"
        )
    if options.optimizer is None:
        if options.optimizer_kwargs:
            raise ValueError(f"distributed table {name!r}: optimizer_kwargs given without an optimizer")
        optimizer = TableOptimizerSpec.derived_from(dense_optimizer)
    else:
        optimizer = TableOptimizerSpec(
            options.optimizer,
            dict(options.optimizer_kwargs),
            dense_optimizer.lr_scheduler,
            dict(dense_optimizer.lr_scheduler_kwargs),
        )
    seed = options.seed
    if seed is None:
        seed = stable_hash_name(f"table:{name}") & 0x7FFFFFFFFFFFFFFF
    if not isinstance(seed, int) or not 0 <= seed < 1 << 63:
        raise ValueError(f"distributed table {name!r}: seed must be an int in [0, 2**63), got {seed!r}")
    if options.init_version not in INIT_VERSIONS:
        raise ValueError(
            f"distributed table {name!r}: init_version {options.init_version!r} is not one of {INIT_VERSIONS}"
        )
    init_kwargs = {**ROW_INITS[options.init], **{k: float(v) for k, v in options.init_kwargs.items()}}
    return TableSpec(
        name=name,
        dim=module.embedding_dim,
        dtype=dtype,
        kind=kind,
        capacity=module.num_embeddings,
        seed=seed,
        init=options.init,
        init_kwargs=init_kwargs,
        optimizer=optimizer,
        mode=mode,
        padding_idx=module.padding_idx,
        include_last_offset=bool(getattr(module, "include_last_offset", False)),
        lifecycle=table_lifecycle(options.lifecycle, name),
        init_version=options.init_version,
    )


def table_options(value: Union[None, TableOptions, Mapping[str, object]]) -> TableOptions:
    """Accept ``None``, a :class:`TableOptions` or a plain dict of its fields."""
    if value is None:
        return TableOptions()
    if isinstance(value, TableOptions):
        return value
    if isinstance(value, Mapping):
        known = {f.name for f in dataclasses.fields(TableOptions)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown table options {unknown}; known: {sorted(known)}")
        return TableOptions(**value)
    raise TypeError(f"table options must be a TableOptions or a dict, got {type(value).__name__}")


def as_ids(ids) -> np.ndarray:
    """``ids`` (a tensor, array or sequence of integers, any shape) as a flat, contiguous int64 array.

    The one way every role reads ids: the trainer's lookups (any shape) and a
    table shard's requests. Raises ``TypeError`` naming the dtype when the ids
    are not integers.
    """
    if isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"ids must be integers, got {ids.dtype}")
        return np.ascontiguousarray(ids.detach().to("cpu", torch.int64).reshape(-1).numpy())
    arr = np.asarray(ids)
    if arr.size and arr.dtype.kind not in "iu":  # an empty list reads as float64
        raise TypeError(f"ids must be integers, got {arr.dtype}")
    return np.ascontiguousarray(arr.astype(np.int64, copy=False).reshape(-1))


def shard_of(ids: np.ndarray, n_shards: int) -> np.ndarray:
    """The shard (pserver index) of every id among ``n_shards``, as int64: today's routing
    (:func:`transpiler.layout.routing.owner_of`)."""
    return owner_of(ids, n_shards)


def merge_duplicates(ids, rows):
    """(unique ids, per-id sums of ``rows``): one gradient row per id, as torch coalesces.

    ``ids`` is a 1-D int array (or tensor); ``rows`` a numpy array or torch
    tensor with one row per id (the sums keep its type, dtype and device).
    Unique ids come out sorted. When the ids have no duplicates the inputs
    come back unchanged, without a copy: a plain sort detects that (0.5 ms per
    100k ids, several times cheaper than ``np.unique``); otherwise
    ``np.unique`` and ``index_add_`` merge them.
    """
    is_tensor = isinstance(ids, torch.Tensor)
    key = ids.detach().cpu().numpy() if is_tensor else np.asarray(ids)
    key = key.astype(np.int64, copy=False).reshape(-1)
    if key.size < 2:
        return ids, rows
    s = np.sort(key)
    if (s[1:] != s[:-1]).all():
        return ids, rows
    unique, inverse = np.unique(key, return_inverse=True)
    if isinstance(rows, torch.Tensor):
        values = rows
    else:  # torch.from_numpy needs a writable array; copies only if it is not
        values = torch.from_numpy(np.require(rows, requirements=["C", "W"]))
    index = torch.from_numpy(inverse.reshape(-1)).to(values.device)
    sums = values.new_zeros((unique.size,) + tuple(values.shape[1:])).index_add_(0, index, values)
    if not isinstance(rows, torch.Tensor):
        sums = sums.numpy()
    if is_tensor:
        unique = torch.from_numpy(unique).to(ids.device)
    return unique, sums


def radix_sort(keys, with_order):
    """(``keys`` sorted, the permutation that sorts them) of 1-D int64 ``keys``: ``np.sort(keys)`` and, with
    ``with_order``, ``np.argsort(keys, kind="stable")`` (equal ids keep their order), else an empty array.

    The one definition of sorting ids both sides compile with numba (the trainer a batch's distinct ids,
    :mod:`trainer.embedding.compiled_ids`; a sync pserver the ids of a step's sums,
    :mod:`pserver.tables.compiled.index_kernels`): plain loops over numpy arrays, which uncompiled are the
    same function, slowly (tests). On job S's 6,300 distinct ids a step it costs a third of numpy's
    comparison sort on the 2-core machine.

    One counting sort per byte, lowest first, each stable. The sign bit is flipped so that unsigned byte
    order is int64 order; the counts of all eight bytes are taken in one pass, and a byte every id shares
    (the top ones, usually) is skipped. The positions travel beside the ids only when asked for (a
    quarter more time).
    """
    n = keys.size
    sign = np.uint64(1) << np.uint64(63)
    counts = np.zeros((8, 256), np.int64)
    for i in range(n):
        u = np.uint64(keys[i]) ^ sign
        for d in range(8):
            counts[d, np.int64((u >> np.uint64(8 * d)) & np.uint64(255))] += 1
    src_keys, dst_keys = keys.copy(), np.empty(n, np.int64)
    m = n if with_order else 0
    src, dst = np.arange(m), np.empty(m, np.int64)
    at = np.empty(256, np.int64)
    for d in range(8):
        shift = np.uint64(8 * d)
        if n == 0 or counts[d, np.int64(((np.uint64(src_keys[0]) ^ sign) >> shift) & np.uint64(255))] == n:
            continue
        start = 0
        for b in range(256):
            at[b] = start
            start += counts[d, b]
        for i in range(n):
            key = src_keys[i]
            b = np.int64(((np.uint64(key) ^ sign) >> shift) & np.uint64(255))
            k = at[b]
            dst_keys[k] = key
            if with_order:
                dst[k] = src[i]
            at[b] = k + 1
        src_keys, dst_keys = dst_keys, src_keys
        src, dst = dst, src
    return src_keys, src
