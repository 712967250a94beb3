"""The generated series of requests for each method of the pserver under fuzz (tests/pserver/test_fuzz.py).

:func:`generate_cases` turns a method's valid base request (fuzz_cases.base_requests) into a
seeded, deterministic series of cases: random bytes, protobuf-shaped garbage, random tensor
pieces, byte-level, wire-level (fuzz_wire) and typed mutations of the base, splices with another
method's base, the hand-made cases of ``Env.crafted`` (fuzz_crafted) and, for client streams, bad
sequences of the base's messages (:func:`stream_cases`).
"""

from __future__ import annotations

import copy
import os
import random
from typing import List, Optional, Tuple

import numpy as np
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message_factory import GetMessageClass

from psproto import ps_pb2
from psproto.dtypes import DTYPES

from .fuzz_cases import DIM, METHODS, STREAM_CHUNK, WRONG_DIGEST, Case, Env, push_stream
from .fuzz_wire import MASK64, byte_mutation, random_fields, wire_mutation

# PS_FUZZ_SCALE: SCALE times more generated cases, for a deeper run.
SCALE = int(os.environ.get("PS_FUZZ_SCALE", "1"))

# Generated cases per method and kind (besides the hand-made ones and the stream sequences).
N_RANDOM, N_SHAPED, N_PIECES = 5 * SCALE, 4 * SCALE, 6 * SCALE
N_BYTES, N_WIRE, N_TYPED, N_SPLICE = 12 * SCALE, 10 * SCALE, 12 * SCALE, 4 * SCALE


DTYPE_NAMES = [
    "",
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "int64",
    "int32",
    "bool",
    "uint8",
    "complex64",
    "torch.float32",
    "FLOAT32",
    "float32 ",
    "float32\0",
    "\u00e9",
]


def int_choices(fd, e: Env) -> list:
    if fd.name == "trainer_id":
        return [-1, 1, 2, 3, 2**31 - 1, -(2**31)]
    if fd.name == "step":
        return [-1, -(2**63), 1, 4, 6, 2**63 - 1, 0]
    if fd.name in ("min_step", "checkpoint_step"):  # no 1: that waits for the barrier (hand-made once)
        return [-1, -(2**63), 0, 2, 7, 2**62, 2**63 - 1]
    if fd.type == FieldDescriptor.TYPE_UINT64 or fd.type == FieldDescriptor.TYPE_UINT32:
        top = MASK64 if fd.type == FieldDescriptor.TYPE_UINT64 else 2**32 - 1
        return [0, 1, 3, 4, 8, 4096, 2**31, top]
    if fd.type == FieldDescriptor.TYPE_INT32:
        return [-1, 0, 1, 2, 2**31 - 1, -(2**31)]
    return [-1, 0, 1, 2, 2**31, 2**62, 2**63 - 1, -(2**63)]


def str_choices(fd, value: str, e: Env) -> list:
    junk = ["", "x", "\u00e9\u00e9", "\0", "a" * 3000, value[:-1], value + "0", value.upper()]
    if fd.name == "dtype":
        return DTYPE_NAMES
    if fd.name in ("name", "names"):
        return e.names + e.other_blocks + ["nope.block0", "emb@", "@ids", "emb@ids@ids", "emb@rows "] + junk
    if fd.name == "layout_digest":
        return [e.digest, WRONG_DIGEST] + junk
    if fd.name == "session":
        return [e.sessions[1]] + junk
    if fd.name == "directory":
        return [str(e.tmp / "x"), str(e.tmp), "/", "/proc/self/fd/0/x", "relative/dir"] + junk
    return junk


SHAPES = [
    [],
    [0],
    [1],
    [-1],
    [-5, 4],
    [2**62],
    [2**31, 2**31],
    [2**40, DIM],
    [2**27],
    [2**27, DIM],
    [-(2**63)],
    [2**63 - 1],
    [1] * 9,
    [3, 0, 2],
]


def typed_mutation(rng: random.Random, cls, data: bytes, e: Env) -> Optional[Tuple[str, bytes]]:
    """Parse ``data`` as ``cls``, give one field (at any depth) a bad value, re-encode."""
    msg = cls.FromString(data)
    targets = []  # (message, field descriptor, path)

    def walk(m, prefix):
        for fd in m.DESCRIPTOR.fields:
            repeated = fd.is_repeated
            if fd.message_type is not None and repeated:
                items = getattr(m, fd.name)
                if len(items):
                    targets.append((m, fd, prefix + fd.name))
                for i, sub in enumerate(items):
                    walk(sub, f"{prefix}{fd.name}[{i}].")
            elif fd.message_type is not None:
                if m.HasField(fd.name):
                    targets.append((m, fd, prefix + fd.name))
                    walk(getattr(m, fd.name), f"{prefix}{fd.name}.")
            else:
                targets.append((m, fd, prefix + fd.name))

    walk(msg, "")
    if not targets:
        return None
    m, fd, where = rng.choice(targets)
    repeated = fd.is_repeated
    if fd.message_type is not None and repeated:
        items = getattr(m, fd.name)
        op = rng.choice(["drop", "duplicate", "reverse", "swap"])
        copies = [copy.deepcopy(x) for x in items]
        if op == "drop":
            del copies[rng.randrange(len(copies))]
        elif op == "duplicate":
            copies.insert(rng.randrange(len(copies)), copy.deepcopy(rng.choice(copies)))
        elif op == "reverse":
            copies.reverse()
        else:
            i, j = rng.randrange(len(copies)), rng.randrange(len(copies))
            copies[i], copies[j] = copies[j], copies[i]
        del items[:]
        items.extend(copies)
        detail = f"{op} {fd.name}"
    elif fd.message_type is not None:
        m.ClearField(fd.name)
        detail = "cleared"
    elif fd.name == "shape":
        value = rng.choice(SHAPES + [[*getattr(m, "shape"), 1], [d + 1 for d in getattr(m, "shape")]])
        m.ClearField("shape")
        m.shape.extend(value)
        detail = f"= {value}"
    elif repeated and fd.type == FieldDescriptor.TYPE_STRING:
        current = list(getattr(m, fd.name))
        value = rng.choice(
            [
                [],
                [""],
                current * 2,
                current[:1],
                ["nope.block0"],
                ["emb@rows"],
                e.other_blocks,
                current + ["x" * 300],
                [e.names[0]] * 1000,
            ]
        )
        m.ClearField(fd.name)
        getattr(m, fd.name).extend(value)
        detail = f"= {value[:4]}{'...' if len(value) > 4 else ''}"
    elif repeated:
        current = list(getattr(m, fd.name))
        value = rng.choice([[], [-1], [2**31 - 1], current * 2])
        m.ClearField(fd.name)
        getattr(m, fd.name).extend(value)
        detail = f"= {value}"
    elif fd.type == FieldDescriptor.TYPE_BYTES:
        raw = getattr(m, fd.name)
        ops = {
            "truncated by 1": raw[:-1],
            "truncated by 4": raw[:-4],
            "one byte more": raw + b"\0",
            "8 bytes more": raw + bytes(8),
            "empty": b"",
            "doubled": raw * 2,
            "halved": raw[: len(raw) // 2],
            "NaN": np.full(len(raw) // 4, np.nan, np.float32).tobytes() + raw[len(raw) // 4 * 4 :],
            "Inf": np.full(len(raw) // 4, np.inf, np.float32).tobytes() + raw[len(raw) // 4 * 4 :],
            "random": rng.randbytes(len(raw)),
        }
        detail = rng.choice(sorted(ops))
        setattr(m, fd.name, ops[detail])
    elif fd.type == FieldDescriptor.TYPE_STRING:
        value = rng.choice(str_choices(fd, getattr(m, fd.name), e))
        setattr(m, fd.name, value)
        detail = f"= {value[:40]!r}"
    elif fd.type == FieldDescriptor.TYPE_BOOL:
        setattr(m, fd.name, not getattr(m, fd.name))
        detail = "toggled"
    elif fd.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        value = rng.choice([float("nan"), float("inf"), -1.0, 1e308])
        setattr(m, fd.name, value)
        detail = f"= {value}"
    else:
        value = rng.choice(int_choices(fd, e))
        setattr(m, fd.name, value)
        detail = f"= {value}"
    return f"typed: {where} {detail}", msg.SerializeToString()


def random_chunk(rng: random.Random, e: Env, cls, header: Optional[bytes]) -> bytes:
    """A message of random tensor pieces (known names, plausible dtypes, shapes and offsets)."""
    msg = cls()
    if header is not None:
        msg.header.MergeFromString(header)
    for _ in range(rng.randint(1, 4)):
        name = rng.choice(e.names + ["nope.block0", ""])
        expected = e.blocks.get(name) or (
            ("int64", [rng.randint(0, 9)])
            if name.endswith("@ids")
            else ("float32", [rng.randint(0, 9), e.tables.get(name.split("@")[0], 1)])
        )
        dtype = expected[0] if rng.random() < 0.7 else rng.choice(DTYPE_NAMES)
        shape = list(expected[1]) if rng.random() < 0.7 else rng.choice(SHAPES)
        offset = (
            0
            if rng.random() < 0.7
            else rng.choice(int_choices(ps_pb2.TensorPiece.DESCRIPTOR.fields_by_name["offset"], e))
        )
        numel = int(np.prod(shape)) if shape and all(0 <= d < 10**5 for d in shape) else 0
        size = DTYPES[dtype].itemsize * numel if dtype in DTYPES else 4 * numel
        n = size if rng.random() < 0.5 else rng.randint(0, min(size + 16, 4096))
        msg.pieces.add(
            name=name, dtype=dtype, shape=shape, offset=offset, data=rng.randbytes(min(n, 1 << 16))
        )
    return msg.SerializeToString()


def pick_message(rng: random.Random, messages: List[bytes]) -> int:
    return 0 if len(messages) == 1 or rng.random() < 0.4 else rng.randrange(len(messages))


def generate_cases(e: Env, name: str, rng: random.Random) -> List[Case]:
    method = METHODS[name]
    cls = GetMessageClass(method.input_type)
    base = e.bases[name]
    streaming = method.client_streaming
    chunky = "pieces" in cls.DESCRIPTOR.fields_by_name
    cases = [Case("empty bytes", [b""]), Case("6 MiB: over the message size limit", [bytes(6 << 20)])]
    if streaming:
        cases.append(Case("stream without messages", []))

    for _ in range(N_RANDOM):
        n = rng.randint(0, 16) if rng.random() < 0.4 else rng.randint(0, 4096)
        cases.append(Case(f"random {n} bytes", [rng.randbytes(n)]))
    for _ in range(N_SHAPED):
        cases.append(Case("protobuf-shaped garbage", [random_fields(rng)]))
    if chunky:
        header = cls.FromString(base[0]).header.SerializeToString()
        for _ in range(N_PIECES):
            msgs = [random_chunk(rng, e, cls, header if rng.random() < 0.8 else None)]
            if streaming and rng.random() < 0.5:
                msgs += [random_chunk(rng, e, cls, None) for _ in range(rng.randint(1, 3))]
            cases.append(Case("random tensor pieces", msgs))

    def mutate(kind_count, mutator):
        for _ in range(kind_count):
            i = pick_message(rng, base)
            result = mutator(base[i])
            if result is None:
                continue
            desc, data = result
            where = f" of message {i}/{len(base)}" if len(base) > 1 else ""
            cases.append(Case(f"{desc}{where}", base[:i] + [data] + base[i + 1 :]))

    mutate(N_BYTES, lambda d: byte_mutation(rng, d))
    mutate(N_WIRE, lambda d: wire_mutation(rng, d))
    mutate(N_TYPED, lambda d: typed_mutation(rng, cls, d, e))
    others = sorted(n for n in e.bases if n != name)

    def splice(d):
        other_name = rng.choice(others)
        other = rng.choice(e.bases[other_name])
        a, b = rng.randint(0, len(d)), rng.randint(0, len(other))
        return f"splice: {a} bytes of the base + {other_name}'s base from byte {b}", d[:a] + other[b:]

    mutate(N_SPLICE, splice)

    cases += e.crafted.get(name, [])
    if streaming and chunky:
        cases += stream_cases(rng, base, cls)
        if method.input_type.name == "PushChunk":  # the same for a push the pserver would count
            cases += [
                Case(f"{c.desc} (step 0)", c.messages, refuse=True)
                for c in stream_cases(rng, push_stream(e, STREAM_CHUNK, step=0), cls, broken_only=True)
            ]
    elif streaming:  # a client stream of some other message type, added later
        cases += [
            Case("stream: the base twice", base * 2),
            Case("stream: base, then random bytes", base + [rng.randbytes(rng.randint(1, 300))]),
        ]
    return cases


def stream_cases(rng: random.Random, base: List[bytes], cls, broken_only: bool = False) -> List[Case]:
    """Bad sequences of the messages of a valid stream, for client-streaming methods.

    ``broken_only``: just the sequences that break the stream whatever its messages hold,
    marked ``refuse`` (used with a push for the current step, which must not be counted).
    """
    first, rest = base[0], base[1:]
    broken = [  # every one of these leaves some tensor incomplete, out of order or doubled
        Case("stream: header message twice", [first, first] + rest),
        Case("stream: header message again at the end", base + [first]),
        Case("stream: only the header message", [first]),
        Case("stream: every message twice", [m for m in base for _ in range(2)]),
    ]
    parsed = cls.FromString(first)
    header_only = cls(header=parsed.header).SerializeToString()
    pieces_only = cls(pieces=parsed.pieces).SerializeToString()
    broken.append(Case("stream: pieces before the header", [pieces_only, header_only] + rest))
    if len(rest) >= 2:
        shuffled = rest[:]
        while shuffled == rest:
            rng.shuffle(shuffled)
        i = rng.randrange(len(rest))
        broken += [
            Case("stream: messages after the header out of order", [first] + shuffled),
            Case("stream: two messages swapped", [first] + rest[1:2] + rest[:1] + rest[2:]),
            Case(
                f"stream: message {i + 1} repeated (overlapping offsets)", [first] + rest[: i + 1] + rest[i:]
            ),
            Case(f"stream: message {i + 1} missing", [first] + rest[:i] + rest[i + 1 :]),
            Case("stream: cut short", [first] + rest[: len(rest) // 2]),
        ]
    if broken_only:
        return [Case(c.desc, c.messages, refuse=True) for c in broken]
    return broken + [
        Case("stream: header, then random bytes", [first, rng.randbytes(rng.randint(1, 300))]),
        Case("stream: header, then protobuf-shaped garbage", [first, random_fields(rng), random_fields(rng)]),
        Case("stream: header, then empty messages, then the rest", [first, b"", b""] + rest),
        Case("stream: a header without pieces", [header_only]),
        Case("stream: header, then pieces, split in two messages", [header_only, pieces_only] + rest),
    ]
