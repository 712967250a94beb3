"""A cache-line prefetch for the table kernels: LLVM's ``llvm.prefetch``, which numba does not expose.

The kernels find a batch's rows in passes whose loads do not depend on each other, so the CPU overlaps
their cache misses, but only as far as its reorder window reaches: a few rows of a batch of thousands,
each row a miss on a table of millions. Asking for the lines before they are read puts far more of them
in flight at once: on a 3M-row dim-16 table, a lookup of 3,045 Zipf ids 243 -> 204 µs and an SGD apply
316 -> 250 (medians of alternating calls, caches flushed between them). A find's passes go over
:data:`BLOCK` ids at a time, each asking for the lines the next reads; loops over rows ask :data:`AHEAD`
rows on: what is asked for is still in the caches when it is read, whatever the batch. A prefetch
changes no value; where this numba cannot compile it, :func:`prefetch` does nothing.
"""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger(__name__)

# A pass asks for the lines of at most BLOCK ids before the next pass reads them: more, and the first are
# evicted before they are read (100k ids among 10M rows: 9.3 ms with a whole pass ahead, 7.5 blocked).
BLOCK = 2048
# A loop over rows in no order asks for the row AHEAD places on as it reads one.
AHEAD = 16

try:
    import numba
except ImportError:  # no kernels to prefetch for
    numba = None

if numba is not None:
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    @intrinsic
    def _llvm_prefetch(typingctx, array, i):
        """Prefetch the line holding ``array[i]`` (``array[i, 0]`` of a 2-D array) for reading, into every
        cache level."""

        def codegen(context, builder, signature, args):
            array_type = signature.args[0]
            view = context.make_array(array_type)(context, builder, args[0])
            zero = context.get_constant(types.intp, 0)
            i = context.cast(builder, args[1], signature.args[1], types.intp)
            index = [i] + [zero] * (array_type.ndim - 1)
            at = cgutils.get_item_pointer(context, builder, array_type, view, index, wraparound=False)
            byte_pointer = ir.IntType(8).as_pointer()
            i32 = ir.IntType(32)
            fnty = ir.FunctionType(ir.VoidType(), [byte_pointer, i32, i32, i32])
            fn = builder.module.declare_intrinsic("llvm.prefetch", [byte_pointer], fnty)
            # read (0), locality 3 (keep in every level), data cache (1)
            builder.call(fn, [builder.bitcast(at, byte_pointer), i32(0), i32(3), i32(1)])
            return context.get_dummy_value()

        if not isinstance(array, types.Array) or not isinstance(i, types.Integer):
            return None  # not a typing this intrinsic has: numba reports it
        return types.void(array, i), codegen

    @numba.njit(nogil=True, cache=True)
    def _try(a):  # pragma: no cover - compiled
        _llvm_prefetch(a, 0)
        return a[0]

    try:
        _try(np.zeros((2, 2), np.float32))
        _try(np.zeros(2, np.int64))
        prefetch = _llvm_prefetch
    except Exception as e:  # noqa: BLE001 - an llvmlite without it: kernels run without prefetching
        log.info("no llvm.prefetch in this numba (%s): the table kernels run without it", e)

        @numba.njit(inline="always", nogil=True)
        def prefetch(array, i):  # pragma: no cover - compiled
            pass
