"""The data-channel fuzz series (tests/data/test_data_fuzz.py) that stop before a call is served: bytes
before or instead of a hello, hellos the pserver must refuse, and request headers it must refuse. Seeded and
deterministic, as every series (:mod:`tests.helpers.fuzz_data_series`).
"""

from __future__ import annotations

import random
import struct
from dataclasses import replace
from typing import List

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
)

from .fuzz_cases import FUTURE_STEP, TRAINERS, WRONG_DIGEST
from .fuzz_data import (
    ABORTED,
    DEADLINE_EXCEEDED,
    FAILED_PRECONDITION,
    INVALID_ARGUMENT,
    LANES,
    SCALE,
    UNAUTHENTICATED,
    DataCase,
    DataFuzz,
    push_header,
    raw_hello,
    request,
)

N_RANDOM, N_HEADERS = 100 * SCALE, 100 * SCALE


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
