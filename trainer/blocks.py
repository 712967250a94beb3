"""LocalBlocks: the trainer's model parameters seen as the plan's row blocks."""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from transpiler import TrainerProgram
from transpiler.placement import as_rows
from transpiler.plans import BlockSpec


class LocalBlocks:
    """Views of ``model``'s parameters as the blocks of ``program``, for pushing and pulling.

    Checks on construction that the model has every planned parameter with
    the planned shape and dtype. Gradients are read as block views without
    copies; pulled blocks land straight in the parameters (CPU) or in a
    pinned staging tensor first (CUDA).
    """

    def __init__(self, program: TrainerProgram, model: nn.Module):
        params = dict(model.named_parameters())
        for spec in program.params:
            p = params.get(spec.name)
            if p is None:
                raise ValueError(f"the model has no parameter {spec.name!r} named in the plan")
            if list(p.shape) != list(spec.shape) or str(p.dtype).replace("torch.", "") != spec.dtype:
                raise ValueError(
                    f"parameter {spec.name!r} is {p.dtype} {list(p.shape)}, "
                    f"the plan says {spec.dtype} {spec.shape}"
                )
            if not p.is_contiguous():
                p.data = p.data.contiguous()
        self._params = {spec.name: params[spec.name] for spec in program.params}
        self.by_endpoint: Dict[str, List[BlockSpec]] = defaultdict(list)
        for b in program.blocks:
            self.by_endpoint[b.endpoint].append(b)
        self.by_name = {b.name: b for b in program.blocks}
        # What a pserver's answer carries of blocks: every block it owns.
        self.answer_bytes: Dict[str, int] = {
            ep: sum(b.nbytes for b in blocks) for ep, blocks in self.by_endpoint.items()
        }
        # Async pipeline: where blocks pulled in the background wait for install_staged().
        self._staging: Dict[str, torch.Tensor] = {}
        # CUDA parameters: pulled blocks land here, then one non-blocking copy each to the device.
        self._pinned_buffers: Dict[str, torch.Tensor] = {}
        # Each block's view, with the data pointer of the parameter it was cut from (one per block).
        self._views: Dict[str, Tuple[int, torch.Tensor]] = {}

    @property
    def params(self) -> Dict[str, nn.Parameter]:
        """The planned parameters by name, in the plan's order."""
        return self._params

    def dtype_and_shape(self, name: str) -> Optional[Tuple[str, List[int]]]:
        """(dtype, shape) of block ``name``, None if the plan has no such block."""
        b = self.by_name.get(name)
        return None if b is None else (b.dtype, b.shape)

    def view(self, b: BlockSpec) -> torch.Tensor:
        """The rows of block ``b`` in its parameter, shaped as the block.

        Made once and kept (every pull lands in every block: cutting a view costs more than copying
        a small block): a kept view holds its parameter's storage, so while the parameter's data
        pointer is the same its data is that storage; one replaced (``p.data = ...``, ``module.to``)
        gets a new view.
        """
        param = self._params[b.param]
        ptr = param.data_ptr()
        kept = self._views.get(b.name)
        if kept is not None and kept[0] == ptr:
            return kept[1]
        view = as_rows(param.data)[b.row_start : b.row_end].view(b.shape)
        self._views[b.name] = (ptr, view)
        return view

    def grad_rows(self, b: BlockSpec) -> Optional[torch.Tensor]:
        """This process's gradient of block ``b`` (a view, shaped as the block), None if it has none."""
        g = self._params[b.param].grad
        if g is None:
            return None
        if g.is_sparse:
            g = g.to_dense()
        return as_rows(g.contiguous())[b.row_start : b.row_end].view(b.shape)

    def grads(self, endpoint: str) -> List[Tuple[str, torch.Tensor]]:
        """(block name, gradient rows) of ``endpoint``'s blocks whose parameter has a gradient."""
        out, flat, staged = [], {}, False
        for b in self.by_endpoint.get(endpoint, []):
            if b.param not in flat:
                g = self._params[b.param].grad
                if g is not None and g.is_sparse:
                    g = g.to_dense()
                flat[b.param] = None if g is None else as_rows(g.contiguous())
            g = flat[b.param]
            if g is not None:
                rows = g[b.row_start : b.row_end].view(b.shape)
                if rows.device.type == "cuda":  # to the wire through pinned host memory
                    rows = self._pinned("grad:" + b.name, rows).copy_(rows, non_blocking=True)
                    staged = True
                out.append((b.name, rows))
        if staged:
            torch.cuda.current_stream().synchronize()
        return out

    def landing(self) -> "Landing":
        """Where one transfer's blocks land (call :meth:`Landing.install` once it ended)."""
        return Landing(self)

    def _pinned(self, name: str, like: torch.Tensor) -> torch.Tensor:
        buf = self._pinned_buffers.get(name)
        if buf is None:
            buf = self._pinned_buffers[name] = torch.empty(like.shape, dtype=like.dtype, pin_memory=True)
        return buf

    def stage(self, name: str) -> torch.Tensor:
        """A staging buffer for block ``name`` (pulled in the background, installed later)."""
        buf = self._staging.get(name)
        if buf is None:
            b = self.by_name[name]
            buf = self._staging[name] = torch.empty(b.shape, dtype=getattr(torch, b.dtype))
        return buf

    def install_staged(self) -> None:
        """Copy the staged blocks into the parameters."""
        with torch.no_grad():
            for name, t in self._staging.items():
                self.view(self.by_name[name]).copy_(t)


class Landing:
    """Where one transfer's pulled blocks land: the parameters themselves, or pinned buffers first.

    Called with a block name, it gives the tensor the transport decodes
    that block into: the parameter's own rows on the CPU; for a CUDA
    parameter a pinned host buffer, copied to the device by :meth:`install`
    (one non-blocking copy per block, then one synchronize, since the
    buffers are reused by the next transfer).
    """

    def __init__(self, blocks: LocalBlocks):
        self._blocks = blocks
        self._staged: Dict[str, torch.Tensor] = {}

    def __call__(self, name: str) -> torch.Tensor:
        view = self._blocks.view(self._blocks.by_name[name])
        if view.is_cpu:
            return view
        self._staged[name] = self._blocks._pinned(name, view)
        return self._staged[name]

    def install(self) -> None:
        """Copy the blocks that landed in pinned buffers into their CUDA parameters."""
        if not self._staged:
            return
        with torch.no_grad():
            for name, t in self._staged.items():
                self._blocks.view(self._blocks.by_name[name]).copy_(t, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        self._staged = {}
