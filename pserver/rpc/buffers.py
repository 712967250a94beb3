"""A pool of gradient receive buffers, one free list per block.

A push lands in a buffer taken from the pool and goes back once the engine
has folded it into the step's sum (sync) or applied it (async). Reusing warm
memory instead of allocating per push avoids the page faults of fresh large
allocations, which cost several times a plain copy.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Dict, List

import torch


class BufferPool:
    """Hands out contiguous tensors of each block's shape and dtype, and takes them back."""

    def __init__(self, specs: Dict[str, tuple]):
        """``specs`` maps block name to (torch dtype, shape)."""
        self._specs = specs
        self._free: Dict[str, List[torch.Tensor]] = defaultdict(list)
        self._lock = threading.Lock()

    def acquire(self, name: str) -> torch.Tensor:
        """A buffer for block ``name``; its contents are undefined."""
        with self._lock:
            free = self._free[name]
            if free:
                return free.pop()
        dtype, shape = self._specs[name]
        return torch.empty(shape, dtype=dtype)

    def release(self, buffers: Dict[str, torch.Tensor]) -> None:
        """Return buffers, keyed by block name, for reuse."""
        with self._lock:
            for name, t in buffers.items():
                self._free[name].append(t)
