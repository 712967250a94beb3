"""The shared-memory regions trainers on this host named (psproto.shared_memory), mapped once and kept.

A trainer reuses a few regions call after call, so each is mapped on its first
use and kept, up to a bound: past it the least recently used goes (its memory
is freed once no call reads it any more). Regions of a trainer that died stay
mapped only until newer ones push them out.
"""

from __future__ import annotations

import collections
import threading
from typing import Tuple

from psproto.shared_memory import map_region

# Per trainer: two calls at once (a step and a prefetch), a request and an answer region each.
REGIONS_PER_TRAINER = 4


class SharedRegions:
    """Mapped regions by address, least recently used first; thread-safe."""

    def __init__(self, trainers: int):
        self.limit = REGIONS_PER_TRAINER * trainers + REGIONS_PER_TRAINER
        self._views: "collections.OrderedDict[Tuple, memoryview]" = collections.OrderedDict()
        self._lock = threading.Lock()

    def view(self, address) -> memoryview:
        """The whole region ``address`` (a ``SharedRegion``) names; raises SharedMemoryError if unmappable."""
        key = (address.pid, address.fd, address.name, address.size)
        with self._lock:
            view = self._views.get(key)
            if view is not None:
                self._views.move_to_end(key)
                return view
        view = map_region(*key)  # outside the lock: other trainers' calls need not wait for it
        with self._lock:
            self._views[key] = view
            while len(self._views) > self.limit:
                self._views.popitem(last=False)
        return view

    def __len__(self) -> int:
        return len(self._views)
