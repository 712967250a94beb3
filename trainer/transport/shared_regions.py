"""A trainer's shared-memory regions (psproto.shared_memory), kept per pserver and reused call after call.

A push through shared memory takes a pair of regions, one for its request and
one for its answer, and gives it back when the answer has been read. A pair
whose call failed is never reused: the pserver may still write its answer into
it (a call that outlived its deadline). Regions grow, never shrink: sized to
what a call needs with a quarter more, in whole MiB.
"""

from __future__ import annotations

import threading
from typing import Dict, List, NamedTuple

from psproto.shared_memory import Region

_MIB = 1 << 20


class RegionPair(NamedTuple):
    """The regions one call uses: its request goes in ``request``, its answer comes back in ``answer``."""

    request: Region
    answer: Region

    def close(self) -> None:
        self.request.close()
        self.answer.close()


def region_size(nbytes: int) -> int:
    """Bytes of a region for ``nbytes`` of message: a quarter more, in whole MiB."""
    return -(-(nbytes + nbytes // 4 + 4096) // _MIB) * _MIB


def _big_enough(region: Region, nbytes: int) -> Region:
    """``region`` if it holds ``nbytes``, else a new one that does (``region`` closed)."""
    if region.size >= nbytes:
        return region
    region.close()
    return Region(region_size(nbytes))


class RegionPool:
    """Free region pairs per pserver endpoint; thread-safe."""

    def __init__(self):
        self._free: Dict[str, List[RegionPair]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def take(self, endpoint: str, request_bytes: int, answer_bytes: int) -> RegionPair:
        """A pair for ``endpoint`` holding at least these many bytes each, reused or new."""
        with self._lock:
            pairs = self._free.setdefault(endpoint, [])
            pair = pairs.pop() if pairs else None
        if pair is None:
            return RegionPair(Region(region_size(request_bytes)), Region(region_size(answer_bytes)))
        if pair.request.size >= request_bytes and pair.answer.size >= answer_bytes:
            return pair
        return RegionPair(_big_enough(pair.request, request_bytes), _big_enough(pair.answer, answer_bytes))

    def give_back(self, endpoint: str, pair: RegionPair, reusable: bool) -> None:
        """Return ``pair`` after its call: kept for the next call if ``reusable``, else closed."""
        with self._lock:
            if reusable and not self._closed:
                self._free.setdefault(endpoint, []).append(pair)
                return
        pair.close()

    def close(self) -> None:
        """Close every free pair; pairs in use close when given back."""
        with self._lock:
            self._closed = True
            pairs = [p for ps in self._free.values() for p in ps]
            self._free.clear()
        for pair in pairs:
            pair.close()
