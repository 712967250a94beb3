"""A pserver's dense blocks as one flat buffer: where each block sits, a gradient over them, a step's sum.

The blocks of one dtype sit one after another in one tensor at
:class:`psproto.dataplane.payload.DenseLayout`'s offsets (each at a multiple of 64 bytes,
the padding between them zero), so a push's dense section is a gradient as it
comes, and the optimizer updates every block with one call
(:mod:`pserver.flat_optim`). :class:`FlatLayout` counts those offsets in
elements; :class:`FlatGrad` is a gradient over a layout and the blocks it holds;
:class:`DenseSums` is a sync step's dense gradients, summed as they arrive.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from psproto.dataplane.payload import DenseLayout
from psproto.dtypes import DTYPES


@dataclass(frozen=True)
class FlatLayout:
    """Blocks at :class:`DenseLayout`'s offsets in a buffer of ``dtype``, counted in its elements.

    ``starts[i]`` is block i's first element (its byte offset // itemsize), ``numel`` the buffer's
    elements, padding included.
    """

    dense: DenseLayout
    dtype: torch.dtype
    shapes: Tuple[Tuple[int, ...], ...]
    starts: Tuple[int, ...]
    numel: int
    index: Dict[str, int] = field(compare=False, repr=False)

    @classmethod
    def of(cls, blocks: Sequence[Tuple[str, Sequence[int]]], dtype: str) -> "FlatLayout":
        """The layout of ``blocks`` ((name, shape), in order) in one buffer of ``dtype`` (a dtype name)."""
        shapes = tuple(tuple(int(d) for d in shape) for _, shape in blocks)
        dense = DenseLayout.of([(name, math.prod(s), dtype) for (name, _), s in zip(blocks, shapes)])
        size = DTYPES[dtype].itemsize
        return cls(
            dense,
            DTYPES[dtype],
            shapes,
            tuple(o // size for o in dense.offsets),
            dense.nbytes // size,
            {name: i for i, name in enumerate(dense.names)},
        )

    @property
    def names(self) -> Tuple[str, ...]:
        return self.dense.names

    def __len__(self) -> int:
        return len(self.dense)

    def flat(self, i: int, buffer: torch.Tensor) -> torch.Tensor:
        """Block i of ``buffer``, 1-D (a view)."""
        return buffer[self.starts[i] : self.starts[i] + self.dense.numels[i]]

    def view(self, i: int, buffer: torch.Tensor) -> torch.Tensor:
        """Block i of ``buffer`` in its shape (a view)."""
        return self.flat(i, buffer).view(self.shapes[i])

    def zeros(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """A zeroed buffer of this layout (in ``dtype``, by default the layout's)."""
        return torch.zeros(self.numel, dtype=dtype or self.dtype)


class FlatGrad(Mapping[str, torch.Tensor]):
    """A dense gradient as one buffer of ``layout`` and the blocks it holds (``present``; None: all).

    Read by block name as a mapping of the blocks present (views of ``flat``), so it goes wherever
    gradients by block go (the listeners, replication); :meth:`pserver.store.BlockStore.apply` takes
    its buffer as it is. What lies in an absent block, or between blocks, is never read.
    """

    def __init__(self, layout: FlatLayout, flat: torch.Tensor, present: Optional[np.ndarray] = None):
        self.layout = layout
        self.flat = flat
        self.present = present

    def _has(self, i: int) -> bool:
        return self.present is None or bool(self.present[i])

    def __getitem__(self, name: str) -> torch.Tensor:
        i = self.layout.index[name]
        if not self._has(i):
            raise KeyError(name)
        return self.layout.view(i, self.flat)

    def __iter__(self) -> Iterator[str]:
        return (name for i, name in enumerate(self.layout.names) if self._has(i))

    def __len__(self) -> int:
        return len(self.layout) if self.present is None else int(self.present.sum())


class DenseSums:
    """A sync step's dense gradients, summed on arrival into one float64 buffer, and the blocks touched.

    The sum does not depend on the pushes' order: a float64 sum of float32 values is exact while
    their magnitudes span less than 2**29 (53 - 24 bits of headroom), so every order gives the same
    sum; past that, orders may differ in the last bits of the float64 sum, and the float32 mean only
    where the sum lies that close to a float32 rounding tie. :meth:`mean` divides the sum once and
    rounds it once to the blocks' dtype (a float64 quotient rounded to float32 equals the exact
    quotient rounded: 53 >= 2 * 24 + 2). With two trainers that is today's float32 ``(a + b) / 2`` bit
    for bit: there ``a + b`` rounds once and the halving is exact; here the sum is exact (or rounds
    innocuously, as above), the halving exact, and the rounding to float32 the one rounding. (Only
    where a float32 sum overflows to infinity does the float64 mean stay finite.)

    One add per push, in numpy: as cheap as torch's mixed-dtype add on one thread, and not slowed down
    by torch's intra-op threads (with two on a busy 2-core machine, torch's took ten times as long).

    ``layout`` places the blocks in the buffer: the store's own when its blocks share one dtype, so the
    mean is the store's flat gradient; ``dtypes`` are the blocks' own (the mean's).
    """

    def __init__(self, layout: FlatLayout, dtypes: Sequence[torch.dtype]):
        self.layout = layout
        self.dtypes = tuple(dtypes)
        self.uniform = all(d == layout.dtype for d in self.dtypes)
        self.touched = np.zeros(len(layout), dtype=bool)
        self._sum: Optional[np.ndarray] = None  # allocated at the first push, reused every step
        self._mean: Optional[torch.Tensor] = None

    def __bool__(self) -> bool:
        return bool(self.touched.any())

    def _buffer(self) -> np.ndarray:
        if self._sum is None:
            self._sum = np.zeros(self.layout.numel, dtype=np.float64)
        return self._sum

    def _block(self, i: int, buffer: np.ndarray) -> np.ndarray:
        start = self.layout.starts[i]
        return buffer[start : start + self.layout.dense.numels[i]]

    def _add_block(self, i: int, g: np.ndarray) -> None:
        # A block's first gradient of the step is copied, not added to zero: -0.0 stays -0.0.
        acc = self._block(i, self._buffer())
        if self.touched[i]:
            np.add(acc, g, out=acc)
        else:
            np.copyto(acc, g)
            self.touched[i] = True

    def add_flat(self, grad: torch.Tensor, present: Optional[np.ndarray] = None) -> None:
        """Add a push's gradient: a buffer of the layout, with the blocks ``present`` (None: all)."""
        with np.errstate(all="ignore"):  # inf - inf is NaN here as in torch, without a warning
            self._add_flat(_numpy(grad), present)

    def _add_flat(self, g: np.ndarray, present: Optional[np.ndarray]) -> None:
        if g.shape != (self.layout.numel,):
            raise ValueError(f"a flat gradient of {g.size} elements for a layout of {self.layout.numel}")
        if present is not None and present.shape != (len(self.layout),):
            raise ValueError(f"presence of {present.size} blocks for {len(self.layout)}")
        if present is None or present.all():
            acc = self._buffer()
            if not self.touched.any():
                np.copyto(acc, g)
            elif self.touched.all():
                np.add(acc, g, out=acc)
            else:
                for i in range(len(self.layout)):
                    self._add_block(i, self._block(i, g))
            self.touched[:] = True
            return
        for i in np.flatnonzero(present):
            self._add_block(int(i), self._block(int(i), g))

    def add(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Add a push's gradients by block name."""
        with np.errstate(all="ignore"):
            for name, g in grads.items():
                self._add_block(self.layout.index[name], _numpy(g).reshape(-1))

    def mean(self, n: int) -> Union[FlatGrad, Dict[str, torch.Tensor]]:
        """The blocks touched, their sum divided by ``n``: a :class:`FlatGrad` of the layout in a buffer kept
        for the next step (blocks of mixed dtypes: by block name)."""
        present = self.touched.copy()
        if not present.any():
            return {}
        acc = self._buffer()
        if self.uniform:
            if self._mean is None:
                self._mean = self.layout.zeros()
            if self.layout.dtype in (torch.float32, torch.float64):
                with np.errstate(all="ignore"):
                    np.divide(acc, n, out=self._mean.numpy(), casting="same_kind")
            else:  # numpy has no bfloat16: torch rounds the float64 quotient
                self._mean.copy_(torch.from_numpy(acc / n))
            return FlatGrad(self.layout, self._mean, present)
        return {
            name: torch.from_numpy(self._block(i, acc) / n).to(self.dtypes[i]).view(self.layout.shapes[i])
            for i, name in enumerate(self.layout.names)
            if present[i]
        }

    def clear(self) -> None:
        """Forget the step's sums (the buffer is kept for the next step)."""
        self.touched[:] = False


def _numpy(t: torch.Tensor) -> np.ndarray:
    """``t`` as a numpy array sharing its memory (bfloat16, which numpy lacks: its float32 values)."""
    t = t.detach()
    return t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()


def layout_of(blocks: Sequence[Tuple[str, Sequence[int], str]]) -> Tuple[List[FlatLayout], List[List[int]]]:
    """One :class:`FlatLayout` per dtype of ``blocks`` ((name, shape, dtype name), in plan order), in order of
    first appearance; and the positions in ``blocks`` each holds."""
    groups: Dict[str, List[int]] = {}
    for i, (_, _, dtype) in enumerate(blocks):
        groups.setdefault(dtype, []).append(i)
    layouts = [FlatLayout.of([blocks[i][:2] for i in idx], dtype) for dtype, idx in groups.items()]
    return layouts, list(groups.values())
