"""Protobuf on the wire, for fuzzing: varints, a tree of fields to mutate, garbage, byte mutations.

Knows no message type: it works on the fields of any serialized message as found on the wire
(number, wire type, value), so that it can write what no protobuf encoder would: overlong
varints, declared lengths that lie, wrong wire types, keys of field 0, ... Deterministic: every
random choice comes from the ``random.Random`` passed in.
"""

from __future__ import annotations

import copy
import random
from typing import List, Optional, Tuple

MASK64 = (1 << 64) - 1
EXTREME_INTS = [
    0,
    1,
    2,
    3,
    7,
    127,
    128,
    255,
    2**31 - 1,
    2**31,
    2**32,
    2**62,
    2**63 - 1,
    2**63,
    MASK64,
    MASK64 - 1,
    (-(2**31)) & MASK64,
    (-(2**63)) & MASK64,
]


def varint(value: int, pad: int = 0) -> bytes:
    """Protobuf varint of ``value`` (two's complement for negatives), ``pad`` redundant groups longer."""
    value &= MASK64
    groups = []
    while True:
        groups.append(value & 0x7F)
        value >>= 7
        if not value:
            break
    groups += [0] * pad
    return bytes(g | 0x80 for g in groups[:-1]) + bytes(groups[-1:])


def read_varint(buf: bytes, pos: int) -> Tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift >= 70:
            raise ValueError("bad varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


class Node:
    """One protobuf field as found on the wire; ``raw`` (its exact bytes) until changed."""

    __slots__ = ("num", "wire", "value", "raw", "children")

    def __init__(self, num, wire, value, raw=None, children=None):
        self.num, self.wire, self.value, self.raw, self.children = num, wire, value, raw, children

    def key(self, pad: int = 0) -> bytes:
        return varint(self.num << 3 | self.wire, pad)

    def body(self) -> bytes:
        if self.wire == 0:
            return varint(self.value)
        if self.wire == 2:
            payload = self.payload()
            return varint(len(payload)) + payload
        return self.value

    def payload(self) -> bytes:
        return encode_nodes(self.children) if self.children is not None else self.value

    def encode(self) -> bytes:
        return self.raw if self.raw is not None else self.key() + self.body()


def encode_nodes(nodes: List[Node]) -> bytes:
    return b"".join(n.encode() for n in nodes)


def parse_nodes(buf: bytes, depth: int = 0) -> Optional[List[Node]]:
    """The fields of a protobuf message, length-delimited ones parsed further when they parse."""
    nodes, pos = [], 0
    try:
        while pos < len(buf):
            start = pos
            key, pos = read_varint(buf, pos)
            num, wire = key >> 3, key & 7
            if num == 0:
                return None
            if wire == 0:
                value, pos = read_varint(buf, pos)
            elif wire == 2:
                n, pos = read_varint(buf, pos)
                if pos + n > len(buf):
                    return None
                value, pos = bytes(buf[pos : pos + n]), pos + n
            elif wire in (1, 5):
                size = 8 if wire == 1 else 4
                if pos + size > len(buf):
                    return None
                value, pos = bytes(buf[pos : pos + size]), pos + size
            else:
                return None
            node = Node(num, wire, value, raw=bytes(buf[start:pos]))
            if wire == 2 and value and depth < 4:
                node.children = parse_nodes(value, depth + 1)
            nodes.append(node)
    except ValueError:
        return None
    return nodes


def wire_mutation(rng: random.Random, data: bytes) -> Optional[Tuple[str, bytes]]:
    """Change one field of the message on the wire; (description, bytes) or None if not a message."""
    tree = parse_nodes(data)
    if not tree:
        return None
    spots = []  # (siblings, index, ancestors, path)

    def walk(nodes, ancestors, prefix):
        for i, n in enumerate(nodes):
            spots.append((nodes, i, ancestors, f"{prefix}{n.num}"))
            if n.children:
                walk(n.children, ancestors + [n], f"{prefix}{n.num}.")

    walk(tree, [], "")
    siblings, i, ancestors, where = rng.choice(spots)
    n = siblings[i]
    ops = ["overlong key", "wire type", "field number", "duplicate", "drop", "swap", "unknown field"]
    if n.wire == 0:
        ops += ["extreme value"] * 3 + ["overlong value"] * 2 + ["varint of 11 bytes"]
    if n.wire == 2:
        ops += ["length too long"] * 2 + [
            "length too short",
            "overlong length",
            "random payload",
            "empty payload",
        ]
    op = rng.choice(ops)
    detail = op
    if op == "extreme value":
        n.value = rng.choice(EXTREME_INTS)
        detail = f"value {n.value}"
        n.raw = None
    elif op == "overlong value":
        pad = rng.randint(1, 10 - len(varint(n.value)))
        n.raw = n.key() + varint(n.value, pad)
    elif op == "varint of 11 bytes":
        n.raw = n.key() + varint(n.value, 11 - len(varint(n.value)))
    elif op == "overlong key":
        n.raw = n.key(rng.randint(1, 6)) + n.body()
    elif op == "wire type":
        w = rng.choice([w for w in range(8) if w != n.wire])
        detail = f"wire type {n.wire} -> {w}"
        n.raw = varint(n.num << 3 | w) + n.body()
    elif op == "field number":
        num = rng.choice([0, 1, 2, 3, 4, 5, 6, 7, 15, 16, 2**29 - 1])
        detail = f"field number {n.num} -> {num}"
        n.raw = varint(num << 3 | n.wire) + n.body()
    elif op == "duplicate":
        siblings.insert(i, copy.deepcopy(n))
    elif op == "drop":
        del siblings[i]
    elif op == "swap":
        j = rng.randrange(len(siblings))
        siblings[i], siblings[j] = siblings[j], siblings[i]
    elif op == "unknown field":
        siblings.insert(
            rng.randint(0, len(siblings)), Node(rng.randint(6, 2**20), 0, rng.choice(EXTREME_INTS))
        )
    elif op == "length too long":
        payload = n.payload()
        extra = rng.choice([1, 7, 1000, 2**31, 2**32, 2**63, MASK64 - len(payload)])
        detail = f"declared length {len(payload)} + {extra}"
        n.raw = n.key() + varint(len(payload) + extra) + payload
    elif op == "length too short":
        payload = n.payload()
        k = rng.randint(1, max(1, len(payload)))
        n.raw = n.key() + varint(max(0, len(payload) - k)) + payload
    elif op == "overlong length":
        payload = n.payload()
        n.raw = n.key() + varint(len(payload), rng.randint(1, 7)) + payload
    elif op == "random payload":
        n.children, n.value, n.raw = None, rng.randbytes(rng.randint(1, 64)), None
    elif op == "empty payload":
        n.children, n.value, n.raw = None, b"", None
    for a in ancestors:
        a.raw = None
    return f"wire: {detail} at field {where}", encode_nodes(tree)


def random_fields(rng: random.Random, depth: int = 0) -> bytes:
    """Protobuf-shaped garbage: plausible keys, values and nested messages."""
    out = bytearray()
    for _ in range(rng.randint(1, 6)):
        num = rng.choice([1, 1, 2, 2, 3, 4, 5, 6, rng.randint(1, 2**29 - 1)])
        wire = rng.choice([0, 0, 2, 2, 2, 2, 1, 5, 3, 4, 6, 7])
        out += varint(num << 3 | wire)
        if wire == 0:
            out += varint(rng.choice(EXTREME_INTS + [rng.getrandbits(64)]))
        elif wire == 2:
            if depth < 3 and rng.random() < 0.5:
                payload = random_fields(rng, depth + 1)
            else:
                payload = rng.randbytes(rng.randint(0, 64))
            out += varint(len(payload)) + payload
        elif wire in (1, 5):
            out += rng.randbytes(8 if wire == 1 else 4)
    return bytes(out)


def byte_mutation(rng: random.Random, data: bytes) -> Tuple[str, bytes]:
    """One random byte-level change of ``data``; (description, bytes)."""
    b = bytearray(data)
    ops = ["insert", "insert interesting"]
    if b:
        ops += ["bit flips"] * 3 + ["byte replacement"] * 2 + ["truncation"] * 2 + ["deletion", "repeat"]
    op = rng.choice(ops)
    if op == "bit flips":
        k = rng.randint(1, 8)
        for _ in range(k):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        return f"bytes: {k} bit flips", bytes(b)
    if op == "byte replacement":
        k = rng.randint(1, 6)
        for _ in range(k):
            b[rng.randrange(len(b))] = rng.choice([0x00, 0xFF, 0x7F, 0x80, 0x01, rng.randrange(256)])
        return f"bytes: {k} bytes replaced", bytes(b)
    if op == "truncation":
        at = rng.randrange(len(b))
        return f"bytes: truncated at {at} of {len(b)}", bytes(b[:at])
    if op == "deletion":
        at, k = rng.randrange(len(b)), rng.randint(1, 32)
        del b[at : at + k]
        return f"bytes: {k} deleted at {at}", bytes(b)
    if op == "repeat":
        at, k = rng.randrange(len(b)), rng.randint(1, 32)
        b[at:at] = b[at : at + k]
        return f"bytes: {k} repeated at {at}", bytes(b)
    at = rng.randint(0, len(b))
    if op == "insert":
        k = rng.randint(1, 32)
        b[at:at] = rng.randbytes(k)
        return f"bytes: {k} random inserted at {at}", bytes(b)
    b[at:at] = rng.choice(
        [
            b"\xff" * 10,
            b"\x80" * 11,
            b"\x12\xff\xff\xff\xff\x0f",
            b"\x0a\x80\x80\x80\x80\x10",
            b"\x00",
            b"\x0b",
            b"\x0c",
            b"\x22\x00",
        ]
    )
    return f"bytes: interesting bytes inserted at {at}", bytes(b)
