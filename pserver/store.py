"""BlockStore: one pserver's parameter blocks, held as views of flat storage, and the optimizer that updates
them."""

from __future__ import annotations

from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from psproto.dataplane.payload import DenseLayout
from psproto.dtypes import DTYPES
from transpiler import PserverProgram, StartupProgram
from transpiler.optim import LrSchedule, OptimizerSpec
from transpiler.placement import cut_block

from .flat import DenseSums, FlatGrad, FlatLayout, layout_of
from .flat_optim import FlatOptimizer, flat_is_exact


class _Flat:
    """The blocks of one dtype: one flat tensor (``param``) of ``layout``, and their optimizer (None: the
    blocks take deltas)."""

    def __init__(self, layout: FlatLayout, spec: Optional[OptimizerSpec]):
        self.layout = layout
        self.param = layout.zeros()
        self.optimizer = None if spec is None else FlatOptimizer(spec, self.param, layout)

    def add(self, delta: torch.Tensor, present: Optional[np.ndarray], scale: float) -> None:
        """GEO: add ``delta`` (flat) times ``scale`` to the blocks ``present`` (None: all)."""
        if (present is None or present.all()) and flat_is_exact(self.param.dtype):
            self.param.add_(delta, alpha=scale)
            return
        for i in range(len(self.layout)) if present is None else np.flatnonzero(present):
            self.layout.flat(int(i), self.param).add_(self.layout.flat(int(i), delta), alpha=scale)

    def apply_blocks(self, grads: Mapping[int, torch.Tensor], lr: float, scale: Optional[float]) -> None:
        """``grads`` by position in the layout, each in its block's shape: the optimizer's step over their
        views at ``lr`` (``scale`` None), else add them times ``scale`` (deltas)."""
        if scale is None:
            self.optimizer.step_blocks(list(grads), list(grads.values()), lr)
            return
        for i, delta in grads.items():
            self.layout.view(i, self.param).add_(delta, alpha=scale)


class BlockStore:
    """Parameter blocks of one pserver, updated by one torch optimizer.

    The blocks lie at :class:`~psproto.dataplane.payload.DenseLayout`'s offsets in one
    flat tensor per dtype (:mod:`pserver.flat`; one in the usual case, then
    :attr:`flat`), and ``blocks`` maps each name to its view. :meth:`apply_flat`
    updates them from one flat gradient with one call of torch's functional
    optimizer (:mod:`pserver.flat_optim`), equal bit for bit to torch's optimizer
    over the blocks one by one; :meth:`apply` takes gradients by block name.
    Blocks without a gradient are skipped, as torch skips a parameter whose
    ``grad`` is None. Not thread-safe: the engine serialises calls.

    In GEO mode (``config.k_steps``) the trainers run the optimizer and push
    deltas: the blocks keep no optimizer state, and the GEO mode's handler
    (:mod:`pserver.engine.modes.geo_deltas`) adds them scaled (:meth:`add`).
    """

    def __init__(self, program: PserverProgram, startup: Optional[StartupProgram]):
        self.specs = {b.name: b for b in program.blocks}
        initial = startup.tensors if startup is not None else {}
        if startup is not None and startup.endpoint != program.endpoint:
            raise ValueError(
                f"startup program is for {startup.endpoint}, the pserver program for {program.endpoint}"
            )
        for name, spec in self.specs.items():
            if name in initial:
                value, dtype = initial[name], DTYPES[spec.dtype]
                if list(value.shape) != list(spec.shape) or value.dtype != dtype:
                    raise ValueError(
                        f"startup value of {name} is {value.dtype} {list(value.shape)}, "
                        f"the plan says {dtype} {spec.shape}"
                    )
            elif startup is not None:
                raise ValueError(f"startup program has no value for block {name}")
        self.schedule = LrSchedule(program.optimizer)
        plan = [(name, spec.shape, spec.dtype) for name, spec in self.specs.items()]
        # The wire's layout of this pserver's blocks (the data channel's dense part), in plan order.
        self.layout = DenseLayout.of([(name, spec.numel, spec.dtype) for name, spec in self.specs.items()])
        layouts, members = layout_of(plan)
        spec = None if program.config.k_steps else program.optimizer  # GEO: deltas, no optimizer state
        self._groups = [_Flat(layout, spec) for layout in layouts]
        # name -> (group, position in it)
        self._where: Dict[str, Tuple[int, int]] = {
            plan[i][0]: (g, j) for g, idx in enumerate(members) for j, i in enumerate(idx)
        }
        self.blocks: Dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name in self.specs:
                g, j = self._where[name]
                self.blocks[name] = self._groups[g].layout.view(j, self._groups[g].param)
                if name in initial:
                    self.blocks[name].copy_(initial[name])

    @property
    def flat(self) -> Optional[torch.Tensor]:
        """The one flat tensor of every block, at :attr:`layout`'s offsets (None when blocks differ in
        dtype)."""
        return self._groups[0].param if len(self._groups) == 1 else None

    @property
    def flat_layout(self) -> Optional[FlatLayout]:
        """:attr:`flat`'s layout in elements (None when blocks differ in dtype)."""
        return self._groups[0].layout if len(self._groups) == 1 else None

    def expect(self, name: str) -> Optional[Tuple[str, List[int]]]:
        """(dtype, shape) of block ``name``, or None when this pserver does not own it."""
        spec = self.specs.get(name)
        return None if spec is None else (spec.dtype, spec.shape)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.blocks.values())

    def dense_sums(self) -> DenseSums:
        """An empty sum of a sync step's dense gradients, whose mean :meth:`apply` takes as it is."""
        dtypes = [DTYPES[s.dtype] for s in self.specs.values()]
        if len(self._groups) == 1:
            return DenseSums(self._groups[0].layout, dtypes)
        return DenseSums(FlatLayout.of([(n, s.shape) for n, s in self.specs.items()], "float64"), dtypes)

    def apply_flat(self, grad: torch.Tensor, present: Optional[np.ndarray], step: int) -> None:
        """One optimizer step with ``grad``, a flat tensor of :attr:`flat_layout` (blocks of one dtype), on
        the blocks ``present`` (a bool per block in plan order; None: all) with the lr of ``step``.

        What ``grad`` holds in an absent block is never read; between blocks it must be zero (or the
        padding of :attr:`flat` no longer is: the blocks never see it).
        """
        self._update_flat(grad, present, step, None)

    def add_flat(self, delta: torch.Tensor, present: Optional[np.ndarray], scale: float) -> None:
        """GEO: add ``delta`` (flat, as :meth:`apply_flat`'s gradient) times ``scale`` to the blocks
        ``present``."""
        self._update_flat(delta, present, 0, scale)

    def _update_flat(
        self, grad: torch.Tensor, present: Optional[np.ndarray], step: int, scale: Optional[float]
    ) -> None:
        if len(self._groups) != 1:
            raise ValueError("a flat gradient needs this pserver's blocks in one dtype")
        group = self._groups[0]
        if grad.dtype != group.param.dtype or grad.shape != group.param.shape:
            raise ValueError(
                f"a flat gradient of {grad.dtype} {list(grad.shape)} for blocks of "
                f"{group.param.dtype} [{group.layout.numel}]"
            )
        if present is not None:
            if present.shape != (len(group.layout),):
                raise ValueError(f"presence of {present.size} blocks for {len(group.layout)}")
            if not present.any():
                return
        with torch.no_grad():
            if scale is not None:
                group.add(grad, present, scale)
            else:
                group.optimizer.step(grad, present, self.schedule.lr_at(step))

    def apply(self, grads: Mapping[str, torch.Tensor], step: int) -> None:
        """One optimizer step on the blocks in ``grads`` with the lr of ``step``.

        Blocks absent from ``grads`` are skipped, as a parameter without gradient is in single-process
        training. A :class:`~pserver.flat.FlatGrad` of :attr:`flat_layout` (a sync step's mean) is applied
        as it is (:meth:`apply_flat`); other gradients with one functional call over the blocks' views,
        without a copy.
        """
        self._update(grads, step, None)

    def add(self, deltas: Mapping[str, torch.Tensor], scale: float) -> None:
        """GEO: add the blocks' ``deltas`` (by name, or a flat gradient as :meth:`apply` takes) times
        ``scale``; blocks absent from ``deltas`` stay."""
        self._update(deltas, 0, scale)

    def _update(self, grads: Mapping[str, torch.Tensor], step: int, scale: Optional[float]) -> None:
        if not grads:
            return
        if isinstance(grads, FlatGrad) and len(self._groups) == 1:
            layout = self._groups[0].layout
            if grads.layout is layout or grads.layout == layout:
                self._update_flat(grads.flat, grads.present, step, scale)
                return
        parts: List[Dict[int, torch.Tensor]] = [{} for _ in self._groups]
        for name, g in grads.items():
            group, i = self._where[name]
            parts[group][i] = g
        lr = self.schedule.lr_at(step) if scale is None else 0.0
        with torch.no_grad():
            for group, part in zip(self._groups, parts):
                if part:
                    group.apply_blocks(part, lr, scale)

    def block_state(self, name: str) -> Dict[str, object]:
        """Block ``name``'s optimizer state as torch keeps it ({} before its first step, and in GEO mode):
        views, valid until the next update."""
        g, j = self._where[name]
        optimizer = self._groups[g].optimizer
        return {} if optimizer is None else optimizer.state_of(j)

    def saved_blocks(self) -> Dict[str, dict]:
        """Each block's rows and optimizer state, copied: what a checkpoint's ``blocks.pt`` holds.

        ``{block: {"param", "row_start", "row_end", "value", "state"}}``; the rows
        say where the block sits in its parameter, so :meth:`restore` can cut
        blocks of another slicing from it. ``state`` is torch's optimizer state of
        the block, as ``torch.optim`` keeps it (``step`` a 0-dim tensor).
        """
        out = {}
        for name, block in self.blocks.items():
            spec = self.specs[name]
            out[name] = {
                "param": spec.param,
                "row_start": spec.row_start,
                "row_end": spec.row_end,
                "value": block.detach().clone(),
                "state": {
                    k: (v.detach().clone() if torch.is_tensor(v) else v)
                    for k, v in self.block_state(name).items()
                },
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
            g, j = self._where[name]
            if self._groups[g].optimizer is not None:
                self._groups[g].optimizer.check(j, state)
            values[name] = (value, state)
        with torch.no_grad():
            for name, (value, state) in values.items():
                self.blocks[name].copy_(value)
                g, j = self._where[name]
                if self._groups[g].optimizer is not None:
                    self._groups[g].optimizer.load(j, state)

    def read(self, names: Sequence[str], copy: bool) -> List[Tuple[str, torch.Tensor]]:
        """(name, tensor) for ``names``; copies when a concurrent update could tear a read."""
        out = []
        for name in names:
            data = self.blocks[name].detach()
            out.append((name, data.clone() if copy else data))
        return out

    def names(self) -> Iterable[str]:
        return self.blocks.keys()
