"""The series of cases fuzzing a pserver's data channel (tests/data/test_data_fuzz.py), seeded and
deterministic: bytes before or instead of a hello, hellos the pserver must refuse, request headers,
push-pulls (for step 5: the pserver is at step 0, so none may count) written by the trainer's own payload
writer and then mutated or cut short, shared-memory calls, prefetches and pulls. ``PS_FUZZ_SCALE`` makes the
generated part longer. Each series is a function of the pserver under fuzz (fuzz_data's
:class:`~tests.helpers.fuzz_data.DataFuzz`) and a seeded ``random.Random``.
"""

from __future__ import annotations

import os
import random
import struct
from dataclasses import replace
from typing import Callable, Dict, List, Tuple

import numpy as np
import torch

from pserver.data.port import MAX_PAYLOAD
from psproto.dataplane.frames import (
    DROPPED,
    FLAGS,
    HEARTBEAT,
    KINDS,
    MAGIC,
    MAP_REGIONS,
    MAX_DIGEST,
    MAX_LANES,
    MAX_SESSION,
    MAX_STEP_TRAINERS,
    MAX_TOKEN,
    PREFETCH,
    PULL,
    PUSH_PULL,
    SHARED,
    RequestHeader,
    pack_regions,
)
from psproto.dataplane.payload import WIRE_DTYPES, DenseLayout, TableCounts
from psproto.shared_memory import NAME_PREFIX
from trainer.transport.data.payloads import PserverPayloads, Push

from .fuzz_cases import FUTURE_STEP, TRAINERS, WRONG_DIGEST
from .fuzz_data import (
    ABORTED,
    DEADLINE_EXCEEDED,
    FAILED_PRECONDITION,
    INVALID_ARGUMENT,
    LANES,
    UNAUTHENTICATED,
    UNIMPLEMENTED,
    DataCase,
    DataFuzz,
    push_header,
    raw_hello,
    request,
)

# PS_FUZZ_SCALE: SCALE times more generated cases, for a deeper run (as tests/pserver/test_fuzz.py's).
SCALE = int(os.environ.get("PS_FUZZ_SCALE", "1"))
N_RANDOM, N_HEADERS, N_PUSHES, N_CUTS, N_PREFETCHES = (
    100 * SCALE,
    100 * SCALE,
    300 * SCALE,
    30 * SCALE,
    60 * SCALE,
)


def before_hello(d: DataFuzz, rng: random.Random) -> List[DataCase]:
    """Before or instead of a hello: nothing, random bytes, truncated hellos, bad fields, bad text."""
    parts = (d.token.encode(), d.env.sessions[0].encode(), d.env.digest.encode())
    cases = [DataCase("an empty connection, closed at once", b"")]
    for _ in range(N_RANDOM):
        cases.append(DataCase("random bytes", rng.randbytes(rng.randint(0, 300))))
    for _ in range(N_RANDOM // 3):
        cases.append(DataCase("the magic, then random bytes", MAGIC + rng.randbytes(rng.randint(0, 100))))
    hello = d.hello()
    for cut in range(0, len(hello), 3):
        cases.append(DataCase(f"a valid hello cut at {cut} of {len(hello)} bytes", hello[:cut]))
    bad = {
        "bad magic": dict(magic=b"PSDX"),
        "a zero magic": dict(magic=b"\0\0\0\0"),
        "version 0": dict(version=0),
        "version 2": dict(version=2),
        "version 65535": dict(version=0xFFFF),
        "kind 1": dict(kind=1),
        "kind 65535": dict(kind=0xFFFF),
        "0 lanes": dict(lanes=0, slot=0),
        "too many lanes": dict(lanes=MAX_LANES + 1, slot=0),
        "slot past its lanes": dict(slot=LANES + 1),
        "slot 65535": dict(slot=0xFFFF, lanes=0xFFFF),
        "token too long": dict(lengths=(MAX_TOKEN + 1, len(parts[1]), len(parts[2]))),
        "token length 65535": dict(lengths=(0xFFFF, len(parts[1]), len(parts[2]))),
        "session too long": dict(lengths=(len(parts[0]), MAX_SESSION + 1, len(parts[2]))),
        "digest too long": dict(lengths=(len(parts[0]), len(parts[1]), MAX_DIGEST + 1)),
        "lengths longer than the bytes sent": dict(lengths=(len(parts[0]), len(parts[1]), len(parts[2]) + 9)),
    }
    for desc, fields in bad.items():
        cases.append(DataCase(f"a hello with {desc}", raw_hello(parts=parts, **fields)))
    non_utf8 = {
        "an 0xff byte in its token": (b"\xff" + parts[0][1:], parts[1], parts[2]),
        "a surrogate in its session": (parts[0], b"\xed\xa0\x80" + parts[1][3:], parts[2]),
        "a digest cut inside a character": (parts[0], parts[1], parts[2][:-1] + b"\xc3"),
        "a lone continuation byte": (parts[0], parts[1], b"\x80" + parts[2][1:]),
    }
    for desc, text in non_utf8.items():
        cases.append(DataCase(f"a hello with {desc} (not UTF-8)", raw_hello(parts=text)))
    # UTF-8 as a whole, but the lengths (bytes) cut the token inside its first character.
    split = ("é".encode() + parts[0], parts[1], parts[2])
    lengths = (1, len(parts[0]) + 1 + len(parts[1]), len(parts[2]))
    cases.append(
        DataCase("a hello whose token ends inside a character", raw_hello(parts=split, lengths=lengths))
    )
    return cases


def refused_hellos(d: DataFuzz, rng: random.Random) -> List[DataCase]:
    """Hellos that parse but must be refused, each with a refusal frame: token, session, digest, trainer."""
    sessions, token = d.env.sessions, d.token
    refused = [
        ("no token", dict(token=""), (UNAUTHENTICATED,)),
        ("a wrong token", dict(token="".join(rng.choice("abcdef") for _ in token)), (UNAUTHENTICATED,)),
        ("the token and one more character", dict(token=token + "x"), (UNAUTHENTICATED,)),
        ("the token's first half", dict(token=token[: len(token) // 2]), (UNAUTHENTICATED,)),
        ("the token in upper case", dict(token=token.upper()), (UNAUTHENTICATED,)),
        ("a token not in ASCII", dict(token="tök€n"), (UNAUTHENTICATED,)),
        ("no session", dict(session=""), (FAILED_PRECONDITION,)),
        ("a made-up session", dict(session=rng.randbytes(16).hex()), (ABORTED,)),
        ("a session not in ASCII", dict(session="sessiön"), (ABORTED,)),
        ("trainer 1's session", dict(session=sessions[1]), (ABORTED,)),
        ("a wrong layout digest", dict(layout_digest=WRONG_DIGEST), (FAILED_PRECONDITION,)),
        ("no layout digest", dict(layout_digest=""), (FAILED_PRECONDITION,)),
        ("the digest and one more character", dict(layout_digest=d.env.digest + "0"), (FAILED_PRECONDITION,)),
        ("slot 0 of 1 lane and a made-up session", dict(slot=0, lanes=1, session="0" * 32), (ABORTED,)),
    ]
    cases = [
        DataCase(f"a hello of trainer 0 with {desc}", d.hello(**fields), answered=True, statuses=statuses)
        for desc, fields, statuses in refused
    ]
    cases.append(
        DataCase(
            "a hello of trainer 1 with trainer 0's session",
            d.hello(1, session=sessions[0]),
            answered=True,
            statuses=(ABORTED,),
        )
    )
    for trainer in (TRAINERS, TRAINERS + 7, -1, 2**31 - 1, -(2**31)):
        cases.append(
            DataCase(
                f"a hello of trainer {trainer} (out of range) with trainer 0's session",
                d.hello(trainer, session=sessions[0]),
                answered=True,
                statuses=(INVALID_ARGUMENT,),
            )
        )
    return cases


# Values a header's fields take in the generated headers: the edges of each field's range and past them.
_EXTREMES = {
    "kind": (0, PUSH_PULL, PULL, PREFETCH, MAP_REGIONS, 5, 0xFF),
    "flags": (0, SHARED, DROPPED, FLAGS, 4, 0x80, 0xFF),
    "grad_dtype": (0, 1, 2, 3, 4, 5, 0xFF),
    "lanes": (0, 1, 2, LANES, MAX_LANES, MAX_LANES + 1, 64, 0xFF),
    "lane": (0, 1, LANES, MAX_LANES - 1, 0xFF),
    "step_trainers": (0, 1, 3, MAX_STEP_TRAINERS + 1, 2**32 - 1),
    "step": (-1, 1, FUTURE_STEP, 2**62, 2**63 - 1, -(2**63)),
    "min_step": (0, -1, 2, 2**63 - 1, -(2**63)),
    "epoch": (0, -1, 2**63 - 1, -(2**63)),
    "batch": (0, -1, 2**63 - 1),
    "attempt": (0, -1, 2**63 - 1),
    "payload_bytes": (0, 1, 64, MAX_PAYLOAD, MAX_PAYLOAD + 1, 2**63, 2**64 - 1),
}


def bad_headers(d: DataFuzz, rng: random.Random) -> List[DataCase]:
    """After a valid hello: random headers, headers with fields at or past their edges, frames cut short."""
    cases = []
    for _ in range(N_HEADERS):
        data = rng.randbytes(RequestHeader.SIZE) + rng.randbytes(rng.choice((0, 0, 8, 64)))
        cases.append(d.after_hello("a random 64-byte request header", data))
    broken = {
        "unknown kind 0": RequestHeader(0),
        f"unknown kind {max(KINDS) + 1}": RequestHeader(max(KINDS) + 1),
        "unknown kind 255": RequestHeader(0xFF),
        "unknown flags 4": RequestHeader(PULL, flags=4),
        "unknown flags 0x80": RequestHeader(PULL, flags=0x80),
        "0 lanes": RequestHeader(PULL, lanes=0),
        "lane 1 of 1": RequestHeader(PULL, lane=1),
        "lane 255 of 4": RequestHeader(PULL, lanes=4, lane=0xFF),
        f"{MAX_LANES + 1} lanes": RequestHeader(PULL, lanes=MAX_LANES + 1),
        "too many step trainers": push_header(b"", step_trainers=MAX_STEP_TRAINERS + 1),
        "2**32 - 1 step trainers": push_header(b"", step_trainers=2**32 - 1),
        "a payload past the pserver's max": push_header(b"", payload_bytes=MAX_PAYLOAD + 1),
        "a payload of 2**64 - 1 bytes": RequestHeader(PREFETCH, payload_bytes=2**64 - 1),
    }
    for desc, header in broken.items():
        cases.append(d.after_hello(f"a request header with {desc}", header.pack()))
    beat = RequestHeader(HEARTBEAT).pack()
    cases += [
        d.after_hello(
            "a heartbeat carrying 8 bytes",
            request(RequestHeader(HEARTBEAT, payload_bytes=8), bytes(8)),
            answered=True,
            statuses=(INVALID_ARGUMENT,),
        ),
        d.after_hello("a heartbeat, then a header of unknown kind 0", beat + RequestHeader(0).pack(), oks=1),
    ]
    for _ in range(N_HEADERS):
        fields = {f: rng.choice(_EXTREMES[f]) for f in rng.sample(sorted(_EXTREMES), rng.randint(1, 4))}
        header = replace(RequestHeader(PULL), **fields)
        if header.kind == PUSH_PULL and header.step == 0:
            header = replace(header, step=FUTURE_STEP)  # a push for the current step may count
        trainers = [rng.randint(-(2**31), 2**31 - 1) for _ in range(min(header.step_trainers, 8))]
        payload = rng.randbytes(min(header.payload_bytes, 256))
        desc = "a header with " + ", ".join(f"{k} {v}" for k, v in fields.items())
        # Valid pulls and prefetches may be answered: they read.
        cases.append(d.after_hello(desc, request(header, payload, trainers), oks=None))
    head = push_header(d.push_bytes).pack()
    for cut in (1, 10, RequestHeader.SIZE - 1):
        cases.append(d.after_hello(f"a push-pull header cut at {cut} bytes, then the close", head[:cut]))
    trainers = push_header(d.push_bytes, step_trainers=3).pack() + struct.pack("<ii", 0, 1)
    cases.append(d.after_hello("a push-pull cut inside its step trainers, then the close", trainers))
    # A pull waiting for step 1 (the live trainers have not pushed it), then a request before its answer.
    wait = RequestHeader(PULL, min_step=1).pack()
    cases.append(d.after_hello("a second request before the answer to the first", wait + wait))
    cases.append(
        d.after_hello(
            "a pull waiting for step 1 until the barrier's deadline",
            wait,
            answered=True,
            statuses=(DEADLINE_EXCEEDED,),
            wait=2,
        )
    )
    return cases


def _flip_bits(p: bytearray, rng: random.Random) -> str:
    at = [rng.randrange(len(p)) for _ in range(rng.randint(1, 8))]
    for i in at:
        p[i] ^= 1 << rng.randrange(8)
    return f"bits flipped at {at}"


def _set_bytes(p: bytearray, rng: random.Random) -> str:
    at = [rng.randrange(len(p)) for _ in range(rng.randint(1, 8))]
    for i in at:
        p[i] = rng.choice((0, 1, 2, 0x7F, 0x80, 0xFF))
    return f"bytes set at {at}"


def _truncate(p: bytearray, rng: random.Random) -> str:
    n = rng.choice((rng.randrange(len(p)), len(p) - 1, len(p) - 64, 0))
    del p[max(n, 0) :]
    return f"truncated to {len(p)} bytes"


def _extend(p: bytearray, rng: random.Random) -> str:
    extra = rng.choice((1, 8, 64, rng.randint(1, 300)))
    p += rng.randbytes(extra) if rng.random() < 0.5 else bytes(extra)
    return f"extended by {extra} bytes"


def _nonfinite(value: float, dtype: str) -> bytes:
    """``value`` (NaN or an infinity) as a gradient of ``dtype`` travels (bfloat16: float32's high half)."""
    if dtype == "bfloat16":
        return struct.pack("<f", value)[2:]
    return np.array([value], dtype=dtype).tobytes()


class _Mutations:
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
            "bits": _flip_bits,
            "bytes": _set_bytes,
            "truncate": _truncate,
            "extend": _extend,
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


def pushes(d: DataFuzz, rng: random.Random) -> List[DataCase]:
    """After a valid hello: push-pulls for step 5 (the pserver is at step 0), valid and mutated."""
    base = d.push_bytes
    plan = d.payloads.plan_push([], 1, 0, dropped=True)  # a dropped push carries its table counts only
    out = np.zeros(plan.layout.nbytes, dtype=np.uint8)
    d.payloads.write_push(out, plan, 1, 0)
    dropped = out.tobytes()
    refused = dict(answered=True, statuses=(FAILED_PRECONDITION,))
    cases = [
        d.after_hello(
            "the valid push-pull for step 5 (from the future)", request(push_header(base), base), **refused
        ),
        d.after_hello(
            "the valid bfloat16 push-pull for step 5",
            request(push_header(d.narrow_bytes, grad_dtype=d.narrow.grad_dtype), d.narrow_bytes),
            **refused,
        ),
        d.after_hello(
            "a dropped push for step 5",
            request(push_header(dropped, flags=DROPPED, attempt=2), dropped),
            **refused,
        ),
        d.after_hello(
            "a push-pull for step 5 of step trainers [0, 1]",
            request(push_header(base, step_trainers=2), base, [0, 1]),
            **refused,
        ),
    ]
    invalid = dict(answered=True, statuses=(INVALID_ARGUMENT,))
    refusals = {
        "a dropped push carrying gradients": push_header(base, flags=DROPPED),
        "step -1": push_header(base, step=-1),
        "epoch -1": push_header(base, epoch=-1),
        "batch -(2**63)": push_header(base, batch=-(2**63)),
        "an unknown wire dtype": push_header(base, grad_dtype=5),
        "the float16 wire dtype (another layout)": push_header(base, grad_dtype=3),
        "lane 1 of 2 (another layout)": push_header(base, lanes=2, lane=1),
        "an empty payload": push_header(b"", payload_bytes=0),
    }
    for desc, header in refusals.items():
        payload = base if header.payload_bytes else b""
        cases.append(d.after_hello(f"a push-pull with {desc}", request(header, payload), **invalid))
    # The float32 push, and the same narrowed to bfloat16 on the wire (read block by block, then widened).
    bases = [(d.push, d.push_bytes, ""), (d.narrow, d.narrow_bytes, "bfloat16 ")]
    mutations = [(_Mutations(push, d.payloads), push, payload, what) for push, payload, what in bases]
    for number in range(N_PUSHES):
        # Some connections carry several: a refusal leaves the connection open for the next request.
        calls, descs = [], []
        for _ in range(1 if number % 4 else rng.randint(2, 4)):
            layout, push, payload, what = rng.choice(mutations)
            p, done = layout.mutate(payload, rng)
            calls.append(request(push_header(p, grad_dtype=push.grad_dtype), p))
            descs.append(f"a {what}push-pull for step 5, {done}")
        # Whatever the bytes say, a push for step 5 never counts: each is refused, at the latest for its step.
        cases.append(
            d.after_hello(
                " | ".join(descs),
                b"".join(calls),
                answered=True,
                statuses=(INVALID_ARGUMENT, FAILED_PRECONDITION),
            )
        )
    for _ in range(N_CUTS):
        cut = rng.randrange(len(base))
        cases.append(
            d.after_hello(
                f"a push-pull's payload cut at {cut} of {len(base)} bytes, then the close",
                request(push_header(base), base[:cut]),
            )
        )
    # One lane of a push in two: it waits for its partner lane, and its connection goes away meanwhile.
    tensors = [(n, t) for n, t in d.env.grads if n in d.payloads.lane(2, 0).names or "@" in n]
    lane = d.payloads.plan_push(tensors, 2, 0, dropped=False)
    out = np.zeros(lane.layout.nbytes, dtype=np.uint8)
    d.payloads.write_push(out, lane, 2, 0)
    lane_bytes = out.tobytes()
    cases.append(
        d.after_hello(
            "lane 0 of a push-pull in 2 lanes for step 5, closed while it waits for lane 1",
            request(push_header(lane_bytes, lanes=2, lane=0), lane_bytes),
        )
    )
    # The same, kept open: refused at the barrier's deadline (a new attempt, as a trainer's retry is).
    cases.append(
        d.after_hello(
            "lane 0 of a push-pull in 2 lanes for step 5, waiting for lane 1 until its deadline",
            request(push_header(lane_bytes, lanes=2, lane=0, attempt=2), lane_bytes),
            answered=True,
            statuses=(DEADLINE_EXCEEDED,),
            wait=2,
        )
    )
    return cases


def shared(d: DataFuzz, rng: random.Random) -> List[DataCase]:
    """After a valid hello: shared calls with no regions, regions that cannot be mapped, shared calls past
    the regions."""
    invalid = dict(answered=True, statuses=(INVALID_ARGUMENT,))
    n = len(d.push_bytes)
    cases = [
        d.after_hello(
            "a shared push-pull with no regions mapped",
            request(push_header(b"", flags=SHARED, payload_bytes=n)),
            **invalid,
        ),
        d.after_hello(
            "a shared pull with no regions mapped", request(RequestHeader(PULL, flags=SHARED)), **invalid
        ),
        d.after_hello(
            "a shared prefetch with no regions mapped",
            request(RequestHeader(PREFETCH, flags=SHARED, payload_bytes=len(d.prefetch_bytes))),
            **invalid,
        ),
    ]
    for size in (0, 1, 21, 60, 100):
        payload = rng.randbytes(size)
        cases.append(
            d.after_hello(
                f"map regions of {size} random bytes",
                request(RequestHeader(MAP_REGIONS, payload_bytes=size), payload),
                answered=True,
                statuses=(INVALID_ARGUMENT, UNIMPLEMENTED),
            )
        )
    good, answer = d.address("push"), d.address("answer")
    garbage = {
        "pid 0": replace(good, pid=0),
        "pid -1": replace(good, pid=-1),
        "a pid no process has": replace(good, pid=2**31 - 1),
        "a pid past any": replace(good, pid=2**62),
        "fd -1": replace(good, fd=-1),
        "fd 0 of this process": replace(good, fd=0),
        "fd 2 of this process": replace(good, fd=2),
        "the answer region's fd": replace(good, fd=answer.fd),
        "an fd no file has": replace(good, fd=2**31 - 1),
        "size 0": replace(good, size=0),
        "a size past the region": replace(good, size=good.size + 1),
        "size 2**64 - 1": replace(good, size=2**64 - 1),
        "a name without the prefix": replace(good, name="not-a-region"),
        "a made-up region name": replace(good, name=NAME_PREFIX + "0123456789abcdef"),
        "an empty name": replace(good, name=""),
        "a name of 65535 characters": replace(good, name=NAME_PREFIX + "x" * (0xFFFF - len(NAME_PREFIX))),
    }
    pairs = {f"the request region with {desc}": (address, answer) for desc, address in garbage.items()}
    pairs["the answer region with pid 0"] = (good, replace(answer, pid=0))
    pairs["the answer region with the request region's fd"] = (good, replace(answer, fd=good.fd))
    pairs["the answer region with a size past it"] = (good, replace(answer, size=answer.size + 1))
    for desc, pair in pairs.items():
        payload = pack_regions(*pair)
        cases.append(
            d.after_hello(
                f"map regions: {desc}",
                request(RequestHeader(MAP_REGIONS, payload_bytes=len(payload)), payload),
                answered=True,
                statuses=(INVALID_ARGUMENT, UNIMPLEMENTED),
            )
        )
    payload = pack_regions(good, answer)
    cases.append(
        d.after_hello(
            "map regions with a trailing byte",
            request(RequestHeader(MAP_REGIONS, payload_bytes=len(payload) + 1), payload + b"\0"),
            **invalid,
        )
    )
    bad_name = payload[:-1] + b"\xff"
    cases.append(
        d.after_hello(
            "map regions with a name not in UTF-8",
            request(RequestHeader(MAP_REGIONS, payload_bytes=len(bad_name)), bad_name),
            **invalid,
        )
    )
    # Regions mapped (answered OK), then shared calls that must be refused.
    after_map = {
        "a shared push-pull for step 5": (
            "answer",
            push_header(b"", flags=SHARED, payload_bytes=n),
            FAILED_PRECONDITION,
        ),
        "a shared push-pull past its region": (
            "answer",
            push_header(b"", flags=SHARED, payload_bytes=good.size + 1),
            INVALID_ARGUMENT,
        ),
        "a shared push-pull one byte short": (
            "answer",
            push_header(b"", flags=SHARED, payload_bytes=n - 1),
            INVALID_ARGUMENT,
        ),
        "a shared prefetch of a push's bytes": (
            "answer",
            RequestHeader(PREFETCH, flags=SHARED, payload_bytes=n),
            INVALID_ARGUMENT,
        ),
        # An answer region too small for any answer: each is refused before it reads or counts anything.
        "a shared pull and too small an answer region": (
            "small",
            RequestHeader(PULL, flags=SHARED),
            INVALID_ARGUMENT,
        ),
        "a shared push-pull for step 5 and too small an answer region": (
            "small",
            push_header(b"", flags=SHARED, payload_bytes=n),
            INVALID_ARGUMENT,
        ),
    }
    for desc, (answer_region, header, status) in after_map.items():
        cases.append(
            d.after_hello(
                f"regions mapped, then {desc}",
                d.map_regions("push", answer_region) + request(header),
                oks=1,
                answered=True,
                statuses=(status,),
            )
        )
    ids = RequestHeader(PREFETCH, flags=SHARED, payload_bytes=len(d.prefetch_bytes))
    cases.append(
        d.after_hello(
            "regions mapped, then a shared prefetch and too small an answer region",
            d.map_regions("ids", "small") + request(ids),
            oks=1,
            answered=True,
            statuses=(INVALID_ARGUMENT,),
        )
    )
    cases.append(
        d.after_hello(
            "regions mapped, then two valid shared prefetches (both answered: the regions work)",
            d.map_regions("ids", "answer") + request(ids) + request(ids),
            oks=3,
        )
    )
    return cases


def prefetches(d: DataFuzz, rng: random.Random) -> List[DataCase]:
    """After a valid hello: prefetches of the other shard's ids, with gradients, bad steps; pulls."""
    invalid = dict(answered=True, statuses=(INVALID_ARGUMENT,))
    env = d.env

    def prefetch(ids, **fields) -> bytes:
        plan = d.payloads.plan_prefetch(ids)
        out = np.zeros(plan.layout.nbytes, dtype=np.uint8)
        d.payloads.write_prefetch(out, plan)
        return request(RequestHeader(PREFETCH, payload_bytes=out.size, **fields), out.tobytes())

    foreign = env.foreign_ids
    cases = [
        d.after_hello(
            "a prefetch of the other shard's ids",
            prefetch([("emb@ids", torch.from_numpy(foreign[:5].copy()))]),
            **invalid,
        ),
        d.after_hello(
            "a prefetch of this shard's ids and one of the other's",
            prefetch(
                [
                    ("emb@ids", torch.from_numpy(env.own_ids[:10].copy())),
                    ("bag@ids", torch.from_numpy(np.append(env.own_ids[10:20], foreign[0]))),
                ]
            ),
            **invalid,
        ),
        d.after_hello("a prefetch with min_step -1", prefetch(env.prefetch_ids, min_step=-1), **invalid),
        d.after_hello(
            "a prefetch for step 3 (from the future)",
            prefetch(env.prefetch_ids, min_step=3),
            answered=True,
            statuses=(FAILED_PRECONDITION,),
        ),
        d.after_hello("a prefetch with no payload", request(RequestHeader(PREFETCH)), **invalid),
        d.after_hello(
            "a prefetch carrying a push's payload",
            request(RequestHeader(PREFETCH, payload_bytes=len(d.push_bytes)), d.push_bytes),
            **invalid,
        ),
        d.after_hello("a pull with min_step -1", request(RequestHeader(PULL, min_step=-1)), **invalid),
        d.after_hello(
            "a pull for step 2 (from the future)",
            request(RequestHeader(PULL, min_step=2)),
            answered=True,
            statuses=(FAILED_PRECONDITION,),
        ),
    ]
    counts = TableCounts((3, 0), (len(env.prefetch_ids[0][1]), 0), (True, False)).pack().tobytes()
    graded = counts + d.prefetch_bytes[len(counts) :]
    cases.append(
        d.after_hello(
            "a prefetch whose counts carry gradients",
            request(RequestHeader(PREFETCH, payload_bytes=len(graded)), graded),
            **invalid,
        )
    )
    base = d.prefetch_bytes
    for _ in range(N_PREFETCHES):
        p = bytearray(base)
        done = rng.choice((_flip_bits, _set_bytes, _truncate, _extend))(p, rng)
        # A mutated id may still be one of this shard's: answered, as any read.
        cases.append(
            d.after_hello(
                f"a prefetch, {done}",
                request(RequestHeader(PREFETCH, payload_bytes=len(p)), bytes(p)),
                oks=None,
            )
        )
    return cases


SERIES: Dict[str, Callable[[DataFuzz, random.Random], List[DataCase]]] = {
    "before_hello": before_hello,
    "refused_hellos": refused_hellos,
    "bad_headers": bad_headers,
    "pushes": pushes,
    "shared": shared,
    "prefetches": prefetches,
}
