"""Freed host memory kept for reuse: a trainer frees and re-allocates the same large buffers every step.

Every step, backward allocates each parameter's gradient afresh and the step
frees it again (``zero_grad(set_to_none=True)``); forward does the same with
activations. glibc's malloc serves a buffer above its mmap threshold (at most
32 MiB, adjusted as the process runs) with a fresh ``mmap`` and returns it to
the kernel on ``free``, and trims the top of its heap once more than twice that
lies free there. Either way the next step's buffers are new pages: a page fault
and the kernel zeroing each 4 KiB of them. On job D (38 MB of gradients per step)
that was 11-27 ms of system time per step and ~10% of a trainer's
forward/backward (``benchmarks/results/RESULTS.md``). Raising both thresholds keeps
freed memory in the process for the next step, as PyTorch's caching allocator
does on CUDA and Paddle's allocator does everywhere: the process's resident
memory then stays at its peak instead of shrinking between steps. The first
steps may still grow the heap: torch asks for 64-byte-aligned buffers, which do
not always fit the chunk the previous step freed, so a few extra copies of a
large buffer can pile up before the heap settles (in a loop of one 40 MB tensor,
up to 8 of them; then none more, and no page faults).

Only glibc has ``mallopt``; elsewhere (musl, macOS) nothing changes.
"""

from __future__ import annotations

import ctypes
import functools
import logging

log = logging.getLogger(__name__)

# mallopt's parameters (<malloc.h>).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

# Buffers up to this size come from the heap and are reused; bigger ones (a whole table's
# worth) still get their own mapping, returned to the kernel when freed.
MMAP_THRESHOLD = 256 << 20
# Free memory kept at the top of the heap before it is returned to the kernel.
TRIM_THRESHOLD = 1 << 30


@functools.lru_cache(maxsize=None)
def retain_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed buffers of up to 256 MiB (and up to 1 GiB of free heap) for reuse.

    Process-wide and idempotent: the first call decides, later ones return its
    answer. Returns whether the allocator took both settings (False where there
    is no glibc ``mallopt``, or it refused one; then nothing is changed beyond
    what it took, and a line at DEBUG level says why).
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        log.debug("no mallopt in this process's C library: freed memory goes back to the system as before")
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # The trim threshold first: with only the mmap threshold raised, freed buffers would land
    # on the heap and still be trimmed away.
    took = bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    if not took:
        log.debug("mallopt refused the thresholds: freed memory goes back to the system as before")
    return took
