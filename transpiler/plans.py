"""The plans a transpile produces: plain data that round-trips to bytes.

- :class:`PserverProgram`: what one pserver owns (blocks, one shard of every
  distributed table) and how it updates it.
- :class:`StartupProgram`: the initial values of one pserver's blocks.
- :class:`TrainerProgram`: the whole block layout, seen from a trainer,
  plus the trainer's own model (which is not part of its bytes).

Layout plans serialise as UTF-8 JSON (readable with any tool); the startup
program carries tensors and serialises with ``torch.save``.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from psproto.dtypes import DTYPES

from .config import DistributeTranspilerConfig
from .layout.routing import ROUTING_VERSION
from .optim import OptimizerSpec
from .roles.replicas import replica_endpoints
from .tables import TableSpec

FORMAT_VERSION = 1


@dataclass
class BlockSpec:
    """Rows ``[row_start, row_end)`` of parameter ``param``, owned by ``endpoint``."""

    name: str
    param: str
    index: int
    row_start: int
    row_end: int
    shape: List[int]
    dtype: str
    endpoint: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype].itemsize


@dataclass
class ParamSpec:
    """A dense parameter's full shape and the blocks it was cut into, in row order."""

    name: str
    shape: List[int]
    dtype: str
    blocks: List[BlockSpec]


def _columns(head: List[str], rows: List[List[str]]) -> str:
    """``head`` and ``rows`` as left-aligned, indented text columns."""
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(("  " + fmt.format(*r)).rstrip() for r in [head] + rows)


def _block_table(blocks: List[BlockSpec], with_endpoint: bool) -> str:
    head = ["block", "param", "rows", "shape", "bytes"] + (["pserver"] if with_endpoint else [])
    rows = [
        [
            b.name,
            b.param,
            f"{b.row_start}:{b.row_end}",
            "x".join(map(str, b.shape)) or "scalar",
            f"{b.nbytes:,}",
        ]
        + ([b.endpoint] if with_endpoint else [])
        for b in blocks
    ]
    return _columns(head, rows)


def _mode_name(sync_mode: bool, config: DistributeTranspilerConfig) -> str:
    """How a plan's printout names its mode: sync, async, or GEO with its period."""
    if config.k_steps:
        return f"geo (k_steps={config.k_steps})"
    return "sync" if sync_mode else "async"


def _optimizer_line(spec: OptimizerSpec) -> str:
    line = f"{spec.name} {spec.kwargs}"
    if spec.lr_scheduler:
        line += f", lr_scheduler {spec.lr_scheduler} {spec.lr_scheduler_kwargs}"
    return line


def _tables_table(tables: List[TableSpec], n_shards: int) -> str:
    if not tables:
        return ""
    head = ["table", "kind", "dim", "dtype", "capacity hint", "init", "optimizer"]
    rows = [
        [
            t.name,
            t.kind + (f" ({t.mode})" if t.mode else ""),
            str(t.dim),
            t.dtype,
            f"{t.capacity:,}",
            f"{t.init} {t.init_kwargs}",
            _optimizer_line(t.optimizer),
        ]
        for t in tables
    ]
    return (
        f"\n\n  distributed tables, sharded by id over {n_shards} pservers "
        f"(slots of stable_hash(id), routing version {ROUTING_VERSION}):\n" + _columns(head, rows)
    )


def _dumps(kind: str, payload: dict) -> bytes:
    return json.dumps({"kind": kind, "format_version": FORMAT_VERSION, **payload}, sort_keys=True).encode(
        "utf-8"
    )


def _loads(kind: str, data: bytes) -> dict:
    try:
        obj = json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, TypeError) as e:
        raise ValueError(f"not a serialised {kind}: {e}") from None
    if not isinstance(obj, dict) or obj.get("kind") != kind:
        raise ValueError(
            f"not a serialised {kind} (kind={obj.get('kind') if isinstance(obj, dict) else None!r})"
        )
    if obj.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{kind} format_version {obj.get('format_version')!r} is not {FORMAT_VERSION}")
    obj.pop("kind")
    obj.pop("format_version")
    return obj


def _blocks_from(data: List[dict]) -> List[BlockSpec]:
    return [BlockSpec(**b) for b in data]


def _params_from(data: List[dict]) -> List[ParamSpec]:
    return [ParamSpec(p["name"], p["shape"], p["dtype"], _blocks_from(p["blocks"])) for p in data]


@dataclass
class PserverProgram:
    """Everything one pserver needs: its blocks, its table shards, the optimizer, the mode.

    The pserver holds shard :attr:`shard` (its position in ``pservers``) of
    every table in ``tables``. ``params`` is the whole job's dense layout (every
    parameter with its blocks, this pserver's and the others'), from which a
    change of pserver count computes the next one; ``layout_epoch`` counts the
    changes (0: as transpiled).
    """

    endpoint: str
    pservers: List[str]
    trainers: int
    sync_mode: bool
    optimizer: OptimizerSpec
    blocks: List[BlockSpec]
    config: DistributeTranspilerConfig
    layout_digest: str
    tables: List[TableSpec] = field(default_factory=list)
    params: List[ParamSpec] = field(default_factory=list)
    layout_epoch: int = 0

    @property
    def shard(self) -> int:
        """This pserver's shard: its position in ``pservers``, or its replica's (``server_replicas=2``)."""
        for k, group in enumerate(self.replica_groups):
            if self.endpoint in group:
                return k
        raise ValueError(f"{self.endpoint} is neither a pserver nor a replica of this plan")

    @property
    def replica_groups(self) -> List[List[str]]:
        """Each shard's processes: ``[[pservers[k], its replica], ...]`` (one each without replicas)."""
        return replica_endpoints(self.config, self.pservers)

    @property
    def replicated(self) -> bool:
        return (self.config.server_replicas or 1) > 1

    def to_bytes(self) -> bytes:
        d = dataclasses.asdict(self)
        d["optimizer"] = self.optimizer.to_dict()
        d["config"] = self.config.to_dict()
        d["tables"] = [t.to_dict() for t in self.tables]
        return _dumps("PserverProgram", d)

    @classmethod
    def from_bytes(cls, data: bytes) -> "PserverProgram":
        d = _loads("PserverProgram", data)
        try:
            d["optimizer"] = OptimizerSpec.from_dict(d["optimizer"])
            d["config"] = DistributeTranspilerConfig.from_dict(d["config"])
            d["blocks"] = _blocks_from(d["blocks"])
            d["tables"] = [TableSpec.from_dict(t) for t in d.get("tables", [])]
            d["params"] = _params_from(d.get("params", []))
            return cls(**d)
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed PserverProgram: {e}") from None

    def __str__(self) -> str:
        mode = _mode_name(self.sync_mode, self.config)
        total = sum(b.nbytes for b in self.blocks)
        return (
            f"PserverProgram {self.endpoint}: {mode}, {self.trainers} trainers, "
            f"{len(self.blocks)} blocks, {total:,} bytes, shard {self.shard} of "
            f"{len(self.tables)} tables\n"
            f"  optimizer: {_optimizer_line(self.optimizer)}\n"
            + _block_table(self.blocks, with_endpoint=False)
            + _tables_table(self.tables, len(self.pservers))
        )


@dataclass
class StartupProgram:
    """Initial values of one pserver's blocks, keyed by block name."""

    endpoint: str
    tensors: Dict[str, torch.Tensor]

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        torch.save(
            {
                "kind": "StartupProgram",
                "format_version": FORMAT_VERSION,
                "endpoint": self.endpoint,
                "tensors": self.tensors,
            },
            buf,
        )
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> "StartupProgram":
        try:
            obj = torch.load(io.BytesIO(data), weights_only=True)
        except Exception as e:  # torch raises many types for garbage input
            raise ValueError(f"not a serialised StartupProgram: {e}") from None
        if not isinstance(obj, dict) or obj.get("kind") != "StartupProgram":
            raise ValueError("not a serialised StartupProgram")
        return cls(obj["endpoint"], obj["tensors"])

    def __str__(self) -> str:
        total = sum(t.numel() * t.element_size() for t in self.tensors.values())
        return f"StartupProgram {self.endpoint}: {len(self.tensors)} blocks, {total:,} bytes"


@dataclass
class TrainerProgram:
    """The full layout seen from one trainer, plus that trainer's model.

    ``params`` lists every dense parameter with its blocks in row order;
    ``tables`` every distributed table (sharded over all ``pservers``);
    ``model`` is the trainer's local ``nn.Module`` (not serialised: pass it to
    :meth:`from_bytes`); ``layout_epoch`` counts the changes of pserver count
    the layout went through (0: as transpiled).
    """

    trainer_id: int
    pservers: List[str]
    trainers: int
    sync_mode: bool
    optimizer: OptimizerSpec
    params: List[ParamSpec]
    config: DistributeTranspilerConfig
    layout_digest: str
    tables: List[TableSpec] = field(default_factory=list)
    layout_epoch: int = 0
    model: Optional[torch.nn.Module] = field(default=None, repr=False, compare=False)

    @property
    def blocks(self) -> List[BlockSpec]:
        return [b for p in self.params for b in p.blocks]

    @property
    def collective(self) -> bool:
        """True when the job trains in collective mode (DDP, no pservers): ``config.mode``."""
        return self.config.collective

    @property
    def replica_groups(self) -> Dict[str, List[str]]:
        """Each pserver's processes by its endpoint: ``{pservers[k]: [pservers[k], its replica]}``.

        Without replicas every list holds the pserver alone.
        """
        return {group[0]: group for group in replica_endpoints(self.config, self.pservers)}

    @property
    def replicated(self) -> bool:
        return (self.config.server_replicas or 1) > 1

    def to_bytes(self) -> bytes:
        d = dataclasses.asdict(dataclasses.replace(self, model=None))
        d.pop("model")
        d["optimizer"] = self.optimizer.to_dict()
        d["config"] = self.config.to_dict()
        d["tables"] = [t.to_dict() for t in self.tables]
        return _dumps("TrainerProgram", d)

    @classmethod
    def from_bytes(cls, data: bytes, model: Optional[torch.nn.Module] = None) -> "TrainerProgram":
        d = _loads("TrainerProgram", data)
        try:
            d["optimizer"] = OptimizerSpec.from_dict(d["optimizer"])
            d["config"] = DistributeTranspilerConfig.from_dict(d["config"])
            d["params"] = _params_from(d["params"])
            d["tables"] = [TableSpec.from_dict(t) for t in d.get("tables", [])]
            return cls(**d, model=model)
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed TrainerProgram: {e}") from None

    def __str__(self) -> str:
        if self.collective:
            return self._collective_str()
        mode = _mode_name(self.sync_mode, self.config)
        return (
            f"TrainerProgram trainer {self.trainer_id}/{self.trainers}: {mode}, "
            f"{len(self.params)} params in {len(self.blocks)} blocks on "
            f"{len(self.pservers)} pservers, {len(self.tables)} distributed tables\n"
            f"  optimizer: {_optimizer_line(self.optimizer)}\n"
            + _block_table(self.blocks, with_endpoint=True)
            + _tables_table(self.tables, len(self.pservers))
        )

    def _collective_str(self) -> str:
        """What a collective-mode trainer runs: DDP options, optimizer, every parameter it all-reduces."""
        c = self.config
        local_sgd = (
            f"Local SGD every {c.local_sgd_steps} steps after {c.local_sgd_warmup_steps} warm-up steps"
            if c.use_local_sgd
            else "no Local SGD"
        )
        head = ["param", "shape", "dtype", "bytes"]
        rows = [
            [
                p.name,
                "x".join(map(str, p.shape)) or "scalar",
                p.dtype,
                f"{math.prod(p.shape) * DTYPES[p.dtype].itemsize:,}",
            ]
            for p in self.params
        ]
        return (
            f"TrainerProgram trainer {self.trainer_id}/{self.trainers}: collective (DDP, no pservers), "
            f"{len(self.params)} params, all-reduce buckets of {c.bucket_cap_mb} MiB, {local_sgd}\n"
            f"  optimizer: {_optimizer_line(self.optimizer)}\n" + _columns(head, rows)
        )
