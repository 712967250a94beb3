"""BlockStore: one pserver's parameter blocks and the torch optimizer that updates them."""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from psproto.dtypes import DTYPES
from transpiler import PserverProgram, StartupProgram
from transpiler.optim import LrSchedule
from transpiler.placement import cut_block


class BlockStore:
    """Parameter blocks of one pserver, updated by one torch optimizer.

    Each block is a leaf tensor; :meth:`apply` installs gradients as their
    ``.grad``, sets the step's learning rate and calls ``optimizer.step()``.
    Because the supported torch optimizers act elementwise, updating row
    blocks separately equals updating the whole parameter. Not thread-safe:
    the engine serialises calls.

    In GEO mode (``config.k_steps``) the trainers run the optimizer and push
    deltas: :meth:`apply` adds each divided by the number of trainers
    (:attr:`geo_scale`), and there is no optimizer state.
    """

    def __init__(self, program: PserverProgram, startup: Optional[StartupProgram]):
        self.specs = {b.name: b for b in program.blocks}
        self.blocks: Dict[str, torch.Tensor] = {}
        initial = startup.tensors if startup is not None else {}
        if startup is not None and startup.endpoint != program.endpoint:
            raise ValueError(
                f"startup program is for {startup.endpoint}, the pserver program for {program.endpoint}"
            )
        for name, spec in self.specs.items():
            dtype = DTYPES[spec.dtype]
            if name in initial:
                value = initial[name]
                if list(value.shape) != list(spec.shape) or value.dtype != dtype:
                    raise ValueError(
                        f"startup value of {name} is {value.dtype} {list(value.shape)}, "
                        f"the plan says {dtype} {spec.shape}"
                    )
                block = value.detach().clone().contiguous()
            elif startup is not None:
                raise ValueError(f"startup program has no value for block {name}")
            else:
                block = torch.zeros(spec.shape, dtype=dtype)
            self.blocks[name] = block.requires_grad_(True)
        # GEO: Paddle's scaling. Trainers that synced from the same values move the block to the mean of
        # their models (Local SGD's averaging, each trainer on its own clock); a plain sum would take
        # ``trainers`` optimizer steps' worth per window and diverge at the learning rate of one.
        self.geo_scale: Optional[float] = 1.0 / program.trainers if program.config.k_steps else None
        self.optimizer = (
            program.optimizer.build(self.blocks.values()) if self.blocks and self.geo_scale is None else None
        )
        self.schedule = LrSchedule(program.optimizer)

    def expect(self, name: str) -> Optional[Tuple[str, List[int]]]:
        """(dtype, shape) of block ``name``, or None when this pserver does not own it."""
        spec = self.specs.get(name)
        return None if spec is None else (spec.dtype, spec.shape)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.blocks.values())

    def apply(self, grads: Dict[str, torch.Tensor], step: int) -> None:
        """One optimizer step on the blocks in ``grads`` with the lr of ``step`` (GEO: add the deltas,
        scaled).

        Blocks absent from ``grads`` keep ``grad=None`` and are skipped by torch, as a parameter without
        gradient is in single-process training.
        """
        if not grads:
            return
        if self.geo_scale is not None:
            with torch.no_grad():
                for name, delta in grads.items():
                    self.blocks[name].add_(delta, alpha=self.geo_scale)
            return
        lr = self.schedule.lr_at(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        for name, g in grads.items():
            self.blocks[name].grad = g
        self.optimizer.step()
        for name in grads:
            self.blocks[name].grad = None

    def saved_blocks(self) -> Dict[str, dict]:
        """Each block's rows and optimizer state, copied: what a checkpoint's ``blocks.pt`` holds.

        ``{block: {"param", "row_start", "row_end", "value", "state"}}``; the rows
        say where the block sits in its parameter, so :meth:`restore` can cut
        blocks of another slicing from it.
        """
        out = {}
        opt_state = self.optimizer.state if self.optimizer is not None else {}
        for name, block in self.blocks.items():
            spec = self.specs[name]
            state = opt_state.get(block, {})
            out[name] = {
                "param": spec.param,
                "row_start": spec.row_start,
                "row_end": spec.row_end,
                "value": block.detach().clone(),
                "state": {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in state.items()},
            }
        return out

    def restore(self, saved: Dict[str, list]) -> None:
        """Set every block and its optimizer state from a checkpoint's saved blocks (any slicing).

        ``saved`` is :func:`pserver.checkpoint.layout.load_blocks`'s answer. All blocks
        are cut and checked first; on a mismatch (ValueError) nothing changes.
        """
        values = {}
        for name, spec in self.specs.items():
            try:
                value, state = cut_block(saved, spec.param, spec.row_start, spec.row_end, spec.shape)
            except RuntimeError as e:  # the saved rows do not reshape to this block
                raise ValueError(f"checkpoint does not fit block {name}: {e}") from None
            if value.dtype != self.blocks[name].dtype:
                raise ValueError(
                    f"checkpoint holds {spec.param} as {value.dtype}, the plan says {spec.dtype}"
                )
            values[name] = (value, state)
        with torch.no_grad():
            for name, (value, state) in values.items():
                block = self.blocks[name]
                block.copy_(value)
                if self.optimizer is not None:
                    self.optimizer.state.pop(block, None)
                    if state:
                        self.optimizer.state[block] = state

    def read(self, names: Sequence[str], copy: bool) -> List[Tuple[str, torch.Tensor]]:
        """(name, tensor) for ``names``; copies when a concurrent update could tear a read."""
        out = []
        for name in names:
            data = self.blocks[name].detach()
            out.append((name, data.clone() if copy else data))
        return out

    def names(self) -> Iterable[str]:
        return self.blocks.keys()
