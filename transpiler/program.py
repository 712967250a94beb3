"""Program: a single-machine training setup to be transpiled.

A Program is what a user writes for one machine: a module, the optimizer that
would train it (name + torch keyword arguments), an optional learning-rate
schedule, and which embedding tables are distributed.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Union

import torch

from .optim import OptimizerSpec
from .tables import TableOptions, TableSpec, table_options, table_spec

TablesArg = Union[Sequence[str], Mapping[str, Union[TableOptions, Mapping[str, object], None]]]


class Program:
    """A single-machine training program to be transpiled.

    ``model`` is any ``torch.nn.Module``; every parameter with
    ``requires_grad`` lives on the pservers, buffers stay on the trainers.
    ``optimizer`` names a torch optimizer (see ``transpiler.optim.OPTIMIZERS``)
    and the remaining keyword arguments are its own (``lr``, ``momentum``,
    ``weight_decay``, ``betas``...). ``distributed_tables`` names
    ``nn.Embedding`` / ``nn.EmbeddingBag`` modules whose tables live only on
    the pservers, sharded by id: a list of module names, or a dict from module
    name to :class:`~transpiler.tables.TableOptions` (or a dict of its fields)
    to choose a table's optimizer, initial rows or seed.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: str = "sgd",
        *,
        distributed_tables: TablesArg = (),
        lr_scheduler: Optional[str] = None,
        lr_scheduler_kwargs: Optional[Dict[str, object]] = None,
        **optimizer_kwargs,
    ):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.optimizer = OptimizerSpec(
            optimizer, optimizer_kwargs, lr_scheduler, dict(lr_scheduler_kwargs or {})
        )
        if isinstance(distributed_tables, str):
            distributed_tables = [distributed_tables]
        if not isinstance(distributed_tables, Mapping):
            distributed_tables = {name: None for name in distributed_tables}
        modules = dict(model.named_modules())
        self.tables: List[TableSpec] = []
        for name, options in distributed_tables.items():
            if name not in modules or name == "":
                raise ValueError(f"distributed table {name!r} is not a module of the model")
            self.tables.append(table_spec(name, modules[name], table_options(options), self.optimizer))
        self.distributed_tables = [t.name for t in self.tables]
        params = self.dense_parameters()
        if not params and not self.tables:
            raise ValueError("the model has no trainable parameters")
        for name, p in params:
            if not p.dtype.is_floating_point:
                raise ValueError(
                    f"parameter {name!r} has dtype {p.dtype}; only floating-point parameters can be trained"
                )
            if "@" in name:
                raise ValueError(f"parameter name {name!r} must not contain '@' (reserved on the wire)")

    def dense_parameters(self) -> List[tuple]:
        """(name, parameter) pairs that the pservers own as row blocks."""
        tables = tuple(t + "." for t in self.distributed_tables)
        return [
            (n, p) for n, p in self.model.named_parameters() if p.requires_grad and not n.startswith(tables)
        ]

    def __repr__(self) -> str:
        return (
            f"Program({type(self.model).__name__}, optimizer={self.optimizer.name!r}, "
            f"kwargs={self.optimizer.kwargs}, distributed_tables={self.distributed_tables})"
        )
