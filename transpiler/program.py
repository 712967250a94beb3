"""Program: a single-machine training setup, and the optimizer it names.

A Program is what a user writes for one machine: a module, the optimizer that
would train it (name + torch keyword arguments), an optional learning-rate
schedule, and which embedding tables are distributed. The pservers rebuild the
optimizer from its :class:`OptimizerSpec`, so the spec must be plain data.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence

import torch

# name -> (torch.optim class, defaults we add on top of torch's own)
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {}),
    # Paddle's "momentum" optimizer: SGD whose momentum defaults to 0.9, not 0.
    "momentum": (torch.optim.SGD, {"momentum": 0.9}),
    "adam": (torch.optim.Adam, {}),
    "adamw": (torch.optim.AdamW, {}),
    "adagrad": (torch.optim.Adagrad, {}),
    "rmsprop": (torch.optim.RMSprop, {}),
}

# Schedules that change only the learning rate (no momentum cycling), stepped
# once per training step.
LR_SCHEDULERS = {
    name: getattr(torch.optim.lr_scheduler, name)
    for name in ("StepLR", "MultiStepLR", "ExponentialLR", "CosineAnnealingLR",
                 "LinearLR", "ConstantLR", "PolynomialLR")
}

# Keyword arguments that would change the numerics or the execution engine on
# the pserver in ways the trainer cannot see; refused to keep updates exact.
_REFUSED_KWARGS = {"params", "foreach", "fused", "capturable", "differentiable"}


def _check_kwargs(what: str, cls: type, kwargs: Dict[str, object], skip: Iterable[str]) -> None:
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self"} - set(skip)
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise ValueError(
            f"{what} does not take {unknown}; it accepts {sorted(accepted)}")


@dataclass
class OptimizerSpec:
    """A torch optimizer by name, its keyword arguments, and an lr schedule.

    ``name`` is one of :data:`OPTIMIZERS`; ``kwargs`` are the torch class's own
    keyword names (``lr``, ``momentum``, ``weight_decay``, ``betas``, ``eps``...).
    ``lr_scheduler`` names a class of ``torch.optim.lr_scheduler`` from
    :data:`LR_SCHEDULERS`, built with ``lr_scheduler_kwargs`` and stepped once
    per training step, exactly as a single-process loop that calls
    ``optimizer.step(); scheduler.step()`` would.
    """

    name: str = "sgd"
    kwargs: Dict[str, object] = field(default_factory=dict)
    lr_scheduler: Optional[str] = None
    lr_scheduler_kwargs: Dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.name!r}; choose one of {sorted(OPTIMIZERS)}")
        cls, extra = OPTIMIZERS[self.name]
        self.kwargs = {**extra, **dict(self.kwargs)}
        # betas travel through JSON as lists; torch wants a tuple.
        if "betas" in self.kwargs:
            self.kwargs["betas"] = tuple(self.kwargs["betas"])
        _check_kwargs(f"optimizer {self.name!r} ({cls.__name__})", cls, self.kwargs, _REFUSED_KWARGS)
        if self.lr_scheduler is not None:
            if self.lr_scheduler not in LR_SCHEDULERS:
                raise ValueError(f"unknown lr_scheduler {self.lr_scheduler!r}; "
                                 f"choose one of {sorted(LR_SCHEDULERS)}")
            _check_kwargs(f"lr_scheduler {self.lr_scheduler!r}", LR_SCHEDULERS[self.lr_scheduler],
                          self.lr_scheduler_kwargs, {"optimizer", "verbose"})
        # Build once on a throwaway tensor so bad values fail here, in the
        # user's process, not later on a pserver.
        self.build([torch.zeros(1, requires_grad=True)])
        LrSchedule(self).lr_at(1)

    @property
    def torch_class(self) -> type:
        return OPTIMIZERS[self.name][0]

    def build(self, params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
        """Return a fresh torch optimizer over ``params`` with this spec's kwargs."""
        return self.torch_class(list(params), **self.kwargs)

    def to_dict(self) -> dict:
        kwargs = {k: list(v) if isinstance(v, tuple) else v for k, v in self.kwargs.items()}
        return {"name": self.name, "kwargs": kwargs, "lr_scheduler": self.lr_scheduler,
                "lr_scheduler_kwargs": dict(self.lr_scheduler_kwargs)}

    @classmethod
    def from_dict(cls, data: dict) -> "OptimizerSpec":
        return cls(**data)


class LrSchedule:
    """Learning rate as a function of the training step, from a torch scheduler.

    ``lr_at(s)`` is the rate a single-process loop uses for its step ``s``
    (0-based): the scheduler's value after ``s`` calls of ``scheduler.step()``.
    Values are computed by stepping the real torch scheduler on a dummy
    optimizer and cached, so the pserver matches torch exactly.
    """

    def __init__(self, spec: OptimizerSpec):
        self._spec = spec
        self._lrs: List[float] = []
        self._opt = None
        self._sched = None

    def lr_at(self, step: int) -> float:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self._spec.lr_scheduler is None:
            return float(self._spec.kwargs.get("lr", self._default_lr()))
        if self._sched is None:
            self._opt = self._spec.build([torch.zeros(1, requires_grad=True)])
            cls = LR_SCHEDULERS[self._spec.lr_scheduler]
            self._sched = cls(self._opt, **self._spec.lr_scheduler_kwargs)
            self._lrs.append(float(self._opt.param_groups[0]["lr"]))
        while len(self._lrs) <= step:
            self._opt.step()  # keeps torch from warning about step order
            self._sched.step()
            self._lrs.append(float(self._opt.param_groups[0]["lr"]))
        return self._lrs[step]

    def _default_lr(self) -> float:
        return inspect.signature(self._spec.torch_class.__init__).parameters["lr"].default


class Program:
    """A single-machine training program to be transpiled.

    ``model`` is any ``torch.nn.Module``; every parameter with
    ``requires_grad`` lives on the pservers, buffers stay on the trainers.
    ``optimizer`` names a torch optimizer (see :data:`OPTIMIZERS`) and the
    remaining keyword arguments are its own (``lr``, ``momentum``,
    ``weight_decay``, ``betas``...). ``distributed_tables`` names
    ``nn.Embedding`` modules whose tables live only on the pservers.
    """

    def __init__(self, model: torch.nn.Module, optimizer: str = "sgd", *,
                 distributed_tables: Sequence[str] = (),
                 lr_scheduler: Optional[str] = None,
                 lr_scheduler_kwargs: Optional[Dict[str, object]] = None,
                 **optimizer_kwargs):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.optimizer = OptimizerSpec(optimizer, optimizer_kwargs, lr_scheduler,
                                       dict(lr_scheduler_kwargs or {}))
        modules = dict(model.named_modules())
        for name in distributed_tables:
            if not isinstance(modules.get(name), torch.nn.Embedding):
                raise ValueError(f"distributed table {name!r} is not an nn.Embedding module of the model")
        self.distributed_tables = list(distributed_tables)
        if self.distributed_tables:
            raise NotImplementedError("distributed tables are not available yet")
        params = self.dense_parameters()
        if not params:
            raise ValueError("the model has no trainable parameters")
        for name, p in params:
            if not p.dtype.is_floating_point:
                raise ValueError(f"parameter {name!r} has dtype {p.dtype}; only floating-point "
                                 f"parameters can be trained")

    def dense_parameters(self) -> List[tuple]:
        """(name, parameter) pairs that the pservers own as row blocks."""
        tables = tuple(t + "." for t in self.distributed_tables)
        return [(n, p) for n, p in self.model.named_parameters()
                if p.requires_grad and not n.startswith(tables)]

    def __repr__(self) -> str:
        return (f"Program({type(self.model).__name__}, optimizer={self.optimizer.name!r}, "
                f"kwargs={self.optimizer.kwargs}, distributed_tables={self.distributed_tables})")
