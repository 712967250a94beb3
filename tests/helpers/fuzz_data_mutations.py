"""How the data-channel fuzz mutates bytes: blind mutators (bits, bytes, cut, extended) and
:class:`Mutations`, which knows a push's layout (table counts, non-finite gradients, presence bytes, table
rows). The pushes' and prefetches' series use them (:mod:`tests.helpers.fuzz_data_series`).
"""

from __future__ import annotations

import random
import struct
from typing import Callable, Dict, Tuple

import numpy as np

from psproto.dataplane.payload import WIRE_DTYPES, DenseLayout
from trainer.transport.data.payloads import PserverPayloads, Push


def flip_bits(p: bytearray, rng: random.Random) -> str:
    at = [rng.randrange(len(p)) for _ in range(rng.randint(1, 8))]
    for i in at:
        p[i] ^= 1 << rng.randrange(8)
    return f"bits flipped at {at}"


def set_bytes(p: bytearray, rng: random.Random) -> str:
    at = [rng.randrange(len(p)) for _ in range(rng.randint(1, 8))]
    for i in at:
        p[i] = rng.choice((0, 1, 2, 0x7F, 0x80, 0xFF))
    return f"bytes set at {at}"


def truncate(p: bytearray, rng: random.Random) -> str:
    n = rng.choice((rng.randrange(len(p)), len(p) - 1, len(p) - 64, 0))
    del p[max(n, 0) :]
    return f"truncated to {len(p)} bytes"


def extend(p: bytearray, rng: random.Random) -> str:
    extra = rng.choice((1, 8, 64, rng.randint(1, 300)))
    p += rng.randbytes(extra) if rng.random() < 0.5 else bytes(extra)
    return f"extended by {extra} bytes"


def _nonfinite(value: float, dtype: str) -> bytes:
    """``value`` (NaN or an infinity) as a gradient of ``dtype`` travels (bfloat16: float32's high half)."""
    if dtype == "bfloat16":
        return struct.pack("<f", value)[2:]
    return np.array([value], dtype=dtype).tobytes()


class Mutations:
    """Mutations that know a push's layout: table counts, blocks, presence bytes, wire dtype."""

    def __init__(self, push: Push, payloads: PserverPayloads):
        self.layout = push.layout
        self.lane = payloads.lane(1, 0)
        self.dtype = WIRE_DTYPES.get(push.grad_dtype, "float32")  # FuzzModel's blocks and rows: float32
        self.itemsize = np.dtype(np.uint16 if self.dtype == "bfloat16" else self.dtype).itemsize
        self.offsets = DenseLayout.of(
            list(zip(self.lane.names, self.lane.layout.numels, self.lane.layout.dtypes)), self.dtype
        ).offsets

    def counts(self, p: bytearray, rng: random.Random) -> str:
        offset, nbytes = self.layout.counts
        words = nbytes // 8
        at = rng.sample(range(min(words, 3 * 2)), rng.randint(1, 3))  # the words of 2 tables
        for w in at:
            value = rng.choice((0, 1, 3, 50, 2**20, 2**62, 2**63, 2**64 - 1, rng.getrandbits(64)))
            p[offset + 8 * w : offset + 8 * w + 8] = value.to_bytes(8, "little")
        return f"table count words {at} set"

    def nonfinite(self, p: bytearray, rng: random.Random) -> str:
        i = rng.randrange(len(self.lane.names))
        numel, dense_at = self.lane.layout.numels[i], self.layout.dense[0]
        at = dense_at + self.offsets[i] + self.itemsize * rng.randrange(numel)
        value = rng.choice((float("nan"), float("inf"), float("-inf")))
        p[at : at + self.itemsize] = _nonfinite(value, self.dtype)
        return f"{value} in block {self.lane.names[i]}"

    def presence(self, p: bytearray, rng: random.Random) -> str:
        i = rng.randrange(self.layout.presence[1])
        p[i] = rng.choice((2, 0x80, 0xFF))
        return f"presence byte {i} set to {p[i]}"

    def table_rows(self, p: bytearray, rng: random.Random) -> str:
        table = rng.randrange(len(self.layout.tables))
        offset, nbytes = self.layout.tables[table][1]
        at = offset + self.itemsize * rng.randrange(nbytes // self.itemsize)
        p[at : at + self.itemsize] = _nonfinite(float("nan"), self.dtype)
        return f"NaN in table {table}'s gradient rows"

    def mutate(self, base: bytes, rng: random.Random) -> Tuple[bytes, str]:
        """``base`` mutated once or twice: (the bytes, what was done)."""
        mutations: Dict[str, Callable[[bytearray, random.Random], str]] = {
            "bits": flip_bits,
            "bytes": set_bytes,
            "truncate": truncate,
            "extend": extend,
            "counts": self.counts,
            "nonfinite": self.nonfinite,
            "presence": self.presence,
            "rows": self.table_rows,
        }
        p = bytearray(base)
        chosen = rng.sample(sorted(mutations), rng.randint(1, 2))
        # Those that change the length last: the others find the parts where the layout says.
        chosen.sort(key=lambda m: m in ("truncate", "extend"))
        done = [mutations[m](p, rng) if p else "nothing left to mutate" for m in chosen]
        return bytes(p), "; ".join(done)
