"""Hand-made requests for the fuzzed pserver, nearly all of which MUST be refused (``Case.refuse``).

Pushes with bad tensors, headers or pieces are mostly for the current step (0), so that
accepting one would also show up as a state change. Pushes of valid edge-case tensors are for
a future step: refused, but only after every check of their tensors. Prefetches of valid edge
cases must be answered, bad ones refused; the unary methods get bad trainer ids, digests,
versions, block names and directories. All of these carry trainer 0's live session, so they
reach the checks behind it; the cases of :func:`sessionless_cases` are calls that would change
the job (a push for the current step, a Close of a live trainer, ...) without the trainer's
session, and a second process's Hello for a live trainer id.
"""

from __future__ import annotations

from typing import Dict, List

import numpy as np
import torch
from google.protobuf.message_factory import GetMessageClass

from psproto import ps_pb2
from transpiler.tables import shard_of

from .fuzz_cases import (
    BAG_DIM,
    DIM,
    FUTURE_STEP,
    METHODS,
    ONE_MESSAGE,
    PREFETCH_CHUNK,
    STREAM_CHUNK,
    WRONG_DIGEST,
    Case,
    Env,
    prefetch_stream,
    push_stream,
    table_grads,
)
from .fuzz_wire import varint


def edit_chunks(messages: List[bytes], cls, edit) -> List[bytes]:
    """Parse each message as ``cls``, let ``edit(list_of_messages)`` change them, re-encode."""
    parsed = [cls.FromString(m) for m in messages]
    edit(parsed)
    return [m.SerializeToString() for m in parsed]


def last_piece(msgs):
    return next(m for m in reversed(msgs) if m.pieces).pieces[-1]


def crafted_cases(e: Env) -> Dict[str, List[Case]]:
    out: Dict[str, List[Case]] = {name: [] for name in METHODS}
    d = e.digest
    grads = dict(e.grads)
    block0, (_, shape0) = next(iter(e.blocks.items()))
    g0 = grads[block0]
    nan, inf = float("nan"), float("inf")
    n_emb = len(grads["emb@ids"])

    def with_tensor(name, value, drop=()):
        out_list, done = [], False
        for n, t in e.grads:
            if n in drop:
                continue
            if n == name:
                out_list.append((n, value))
                done = True
            else:
                out_list.append((n, t))
        return out_list if done else out_list + [(name, value)]

    pushes = [  # (description, tensors, header overrides, message edit or None); all step 0 unless said
        ("NaN in a dense gradient", with_tensor(block0, torch.full_like(g0, nan)), {}, None),
        (
            "+Inf in a dense gradient",
            with_tensor(block0, g0.clone().index_fill_(0, torch.tensor([1]), inf)),
            {},
            None,
        ),
        ("NaN in table rows", with_tensor("emb@rows", torch.full((n_emb, DIM), nan)), {}, None),
        ("-Inf in table rows", with_tensor("bag@rows", torch.full((15, BAG_DIM), -inf)), {}, None),
        ("unknown tensor name", with_tensor("nope.block0", torch.zeros(3)), {}, None),
        ("a block of the other pserver", with_tensor(e.other_blocks[0], torch.zeros(3)), {}, None),
        ("unknown table", with_tensor("nope@ids", torch.zeros(3, dtype=torch.int64)), {}, None),
        (
            "dense block with one row too many",
            with_tensor(block0, torch.zeros(shape0[0] + 1, *shape0[1:])),
            {},
            None,
        ),
        ("dense block as float64", with_tensor(block0, g0.double()), {}, None),
        ("table ids as int32", with_tensor("emb@ids", grads["emb@ids"].int()), {}, None),
        ("table ids as float64", with_tensor("emb@ids", grads["emb@ids"].double()), {}, None),
        ("table ids 2-D", with_tensor("emb@ids", grads["emb@ids"].reshape(2, -1)), {}, None),
        ("table rows one column too wide", with_tensor("emb@rows", torch.zeros(n_emb, DIM + 1)), {}, None),
        (
            "table rows as float64",
            with_tensor("emb@rows", torch.zeros(n_emb, DIM, dtype=torch.float64)),
            {},
            None,
        ),
        ("fewer rows than ids", with_tensor("emb@rows", torch.zeros(n_emb - 1, DIM)), {}, None),
        ("more rows than ids", with_tensor("emb@rows", torch.zeros(n_emb + 1, DIM)), {}, None),
        (
            "ids of another shard",
            with_tensor("emb@ids", torch.from_numpy(e.foreign_ids[:n_emb].copy())),
            {},
            None,
        ),
        (
            "one id of another shard among ours",
            with_tensor("emb@ids", torch.cat([grads["emb@ids"][:-1], torch.from_numpy(e.foreign_ids[:1])])),
            {},
            None,
        ),
        ("table ids without rows", with_tensor("emb@ids", grads["emb@ids"], drop=("emb@rows",)), {}, None),
        ("table rows without ids", with_tensor("emb@rows", grads["emb@rows"], drop=("emb@ids",)), {}, None),
        ("a tensor sent twice", e.grads + [(block0, g0)], {}, None),
        ("trainer id 2", None, dict(trainer_id=2), None),
        ("trainer id -1", None, dict(trainer_id=-1), None),
        ("trainer id 2**31-1", None, dict(trainer_id=2**31 - 1), None),
        ("wrong layout digest", None, dict(layout_digest=WRONG_DIGEST), None),
        ("empty layout digest", None, dict(layout_digest=""), None),
        ("step -1", None, dict(step=-1), None),
        ("step -2**63 (far past)", None, dict(step=-(2**63)), None),
        ("step 1 (future)", None, dict(step=1), None),
        ("step 2**63-1 (far future)", None, dict(step=2**63 - 1), None),
        ("no header", None, {}, lambda ms: ms[0].ClearField("header")),
        (
            "last piece one byte short",
            None,
            {},
            lambda ms: setattr(last_piece(ms), "data", last_piece(ms).data[:-1]),
        ),
        (
            "last piece one byte long",
            None,
            {},
            lambda ms: setattr(last_piece(ms), "data", last_piece(ms).data + b"\0"),
        ),
        ("first piece at offset 4", None, {}, lambda ms: setattr(ms[0].pieces[0], "offset", 4)),
        (
            "first piece without a name",
            None,
            {},
            lambda ms: (
                ms[0].ClearField("pieces") or ms[0].pieces.add(dtype="float32", shape=shape0, data=bytes(4))
            ),
        ),
        ("dtype 'torch.float32'", None, {}, lambda ms: setattr(ms[0].pieces[0], "dtype", "torch.float32")),
        ("dtype 'float32' with a NUL", None, {}, lambda ms: setattr(ms[0].pieces[0], "dtype", "float32\0")),
        (
            "shape with a negative dim",
            None,
            {},
            lambda ms: (
                ms[0].pieces[0].ClearField("shape"),
                ms[0].pieces[0].shape.extend([-shape0[0], *shape0[1:]]),
            ),
        ),
        ("a later piece named after another tensor", None, {}, split_into_other_tensor),
    ]
    for desc, tensors, header, edit in pushes:
        header = {"step": 0, **header}
        for name, chunk in (("PushPull", STREAM_CHUNK), ("PushPullOne", ONE_MESSAGE)):
            messages = push_stream(e, chunk, tensors, **header)
            if edit is not None:
                messages = edit_chunks(messages, ps_pb2.PushChunk, edit)
            out[name].append(Case(f"hand-made: {desc}", messages, refuse=True))

    # Protobuf merges a message field that occurs twice: this header says step 5 (refused), not 0.
    split = (
        ps_pb2.PushHeader(step=FUTURE_STEP).SerializeToString(),
        ps_pb2.PushHeader(trainer_id=0, layout_digest=d, epoch=1, batch=2).SerializeToString(),
    )
    for name, chunk in (("PushPull", STREAM_CHUNK), ("PushPullOne", ONE_MESSAGE)):
        messages = push_stream(e, chunk, step=0)
        first = ps_pb2.PushChunk.FromString(messages[0])
        first.ClearField("header")
        messages[0] = (
            b"".join(varint(1 << 3 | 2) + varint(len(h)) + h for h in split) + first.SerializeToString()
        )
        out[name].append(
            Case("hand-made: header split over two fields (merged: step 5)", messages, refuse=True)
        )

    # Edge cases of valid tensors, for step 5 (refused, but only after every check of the tensors).
    extremes = np.array([-(2**63), 2**63 - 1, 0, -1, 1, 2**31, -(2**31)], dtype=np.int64)
    extremes = extremes[shard_of(extremes, 2) == e.server.program.shard]
    dup = np.repeat(e.own_ids[:4], 50)
    edges = [
        (
            "empty table gradients",
            table_grads(e, "emb", e.own_ids[:0]) + table_grads(e, "bag", e.own_ids[:0]),
        ),
        ("duplicate ids", table_grads(e, "emb", dup)),
        ("extreme ids", table_grads(e, "emb", extremes)),
        ("only a scalar-sized block", [(n, t) for n, t in e.grads if t.numel() <= 2]),
        ("nothing but the header", []),
    ]
    for desc, tensors in edges:
        for name, chunk in (("PushPull", STREAM_CHUNK), ("PushPullOne", ONE_MESSAGE)):
            out[name].append(
                Case(f"hand-made: {desc} at step {FUTURE_STEP}", push_stream(e, chunk, tensors), refuse=True)
            )
    valid_prefetches = [
        ("empty ids", [("emb@ids", torch.zeros(0, dtype=torch.int64))]),
        ("extreme ids", [("emb@ids", torch.from_numpy(extremes))]),
        ("one id 2000 times", [("bag@ids", torch.from_numpy(np.repeat(e.own_ids[:1], 2000)))]),
        ("no tables", []),
    ]
    for desc, tensors in valid_prefetches:
        for name, chunk in (("Prefetch", PREFETCH_CHUNK * 16), ("PrefetchOne", ONE_MESSAGE)):
            out[name].append(Case(f"valid: {desc}", prefetch_stream(e, chunk, tensors)))
    many = np.resize(e.own_ids, 50_000)
    out["PrefetchOne"].append(
        Case("valid: 50000 ids", prefetch_stream(e, ONE_MESSAGE, [("emb@ids", torch.from_numpy(many))]))
    )

    ids = dict(e.prefetch_ids)
    prefetches = [
        ("ids of another shard", [("emb@ids", torch.from_numpy(e.foreign_ids[:10].copy()))], {}, None),
        ("table rows in a prefetch", [("emb@rows", torch.zeros(3, DIM))], {}, None),
        ("ids and rows in a prefetch", table_grads(e, "emb", e.own_ids[:3]), {}, None),
        ("unknown table", [("nope@ids", ids["emb@ids"])], {}, None),
        ("a dense block in a prefetch", [(block0, g0)], {}, None),
        ("ids as float64", [("emb@ids", ids["emb@ids"].double())], {}, None),
        ("ids as int32", [("emb@ids", ids["emb@ids"].int())], {}, None),
        ("ids 2-D", [("emb@ids", ids["emb@ids"][:64].reshape(8, 8))], {}, None),
        ("the same table twice", e.prefetch_ids + [("emb@ids", ids["emb@ids"])], {}, None),
        ("min_step -1", None, dict(min_step=-1), None),
        ("min_step 2 (beyond reach)", None, dict(min_step=2), None),
        ("min_step 2**63-1", None, dict(min_step=2**63 - 1), None),
        ("trainer id 2", None, dict(trainer_id=2), None),
        ("trainer id -1", None, dict(trainer_id=-1), None),
        ("wrong layout digest", None, dict(layout_digest=WRONG_DIGEST), None),
        ("no header", None, {}, lambda ms: ms[0].ClearField("header")),
        (
            "ids piece 8 bytes short",
            None,
            {},
            lambda ms: setattr(last_piece(ms), "data", last_piece(ms).data[:-8]),
        ),
        (
            "ids piece 3 bytes long",
            None,
            {},
            lambda ms: setattr(last_piece(ms), "data", last_piece(ms).data + b"abc"),
        ),
        (
            "ids shape 2**40",
            None,
            {},
            lambda ms: (ms[0].pieces[0].ClearField("shape"), ms[0].pieces[0].shape.append(2**40)),
        ),
        (
            "ids shape -1",
            None,
            {},
            lambda ms: (ms[0].pieces[0].ClearField("shape"), ms[0].pieces[0].shape.append(-1)),
        ),
    ]
    for desc, tensors, header, edit in prefetches:
        for name, chunk in (("Prefetch", PREFETCH_CHUNK), ("PrefetchOne", ONE_MESSAGE)):
            messages = prefetch_stream(e, chunk, tensors, **header)
            if edit is not None:
                messages = edit_chunks(messages, ps_pb2.PrefetchChunk, edit)
            out[name].append(Case(f"hand-made: {desc}", messages, refuse=True))

    def unary(name, desc, **fields):
        cls = GetMessageClass(METHODS[name].input_type)
        if "session" in cls.DESCRIPTOR.fields_by_name:
            fields.setdefault("session", e.sessions[0])
        out[name].append(Case(f"hand-made: {desc}", [cls(**fields).SerializeToString()], refuse=True))

    names = sorted(e.blocks)
    for desc, kw in [
        ("unknown block", dict(names=["nope.block0"])),
        ("a table's rows", dict(names=["emb@rows"])),
        ("a block of the other pserver", dict(names=e.other_blocks[:1])),
        ("an empty name", dict(names=[""])),
        ("min_step -1", dict(min_step=-1)),
        ("min_step 2 (beyond reach)", dict(min_step=2)),
        ("min_step 2**63-1", dict(min_step=2**63 - 1)),
        ("min_step -2**63", dict(min_step=-(2**63))),
        ("trainer id 2", dict(trainer_id=2)),
        ("trainer id -1", dict(trainer_id=-1)),
        ("wrong layout digest", dict(layout_digest=WRONG_DIGEST)),
        ("empty layout digest", dict(layout_digest="")),
        ("min_step 1: waits for a step nobody pushes", dict(min_step=1)),
    ]:
        unary("Pull", desc, **{"trainer_id": 0, "names": names, "layout_digest": d, **kw})
    for tid in (2, -1, 2**31 - 1):
        unary("Hello", f"trainer id {tid}", trainer_id=tid, layout_digest=d)
        unary("Close", f"trainer id {tid}", trainer_id=tid)
        unary("Heartbeat", f"trainer id {tid}", trainer_id=tid)
        unary("SaveTables", f"trainer id {tid}", trainer_id=tid, directory=str(e.tmp / "t"), layout_digest=d)
        unary("Checkpoint", f"trainer id {tid}", trainer_id=tid, layout_digest=d)
        unary("Restore", f"trainer id {tid}", trainer_id=tid, checkpoint_step=0, token="x", layout_digest=d)
    unary("Close", "trainer id -2**31", trainer_id=-(2**31))
    unary("Hello", "empty layout digest", trainer_id=0, layout_digest="")
    a_file = e.tmp / "a-file"
    a_file.write_text("not a directory")
    unary(
        "SaveTables",
        "wrong layout digest",
        trainer_id=0,
        directory=str(e.tmp / "t"),
        layout_digest=WRONG_DIGEST,
    )
    unary("SaveTables", "no directory", trainer_id=0, directory="", layout_digest=d)
    unary(
        "SaveTables", "a NUL in the directory", trainer_id=0, directory=str(e.tmp / "a\0b"), layout_digest=d
    )
    unary(
        "SaveTables", "a directory below a file", trainer_id=0, directory=str(a_file / "t"), layout_digest=d
    )
    unary("Checkpoint", "empty layout digest", trainer_id=0, layout_digest="")
    for desc, kw in [
        ("wrong layout digest", dict(layout_digest=WRONG_DIGEST)),
        ("checkpoint_step -1", dict(checkpoint_step=-1)),
        ("checkpoint_step 7: no such checkpoint", {}),
        ("checkpoint_step 2**63-1", dict(checkpoint_step=2**63 - 1)),
        ("no token", dict(token="")),
    ]:
        unary(
            "Restore", desc, **{"trainer_id": 0, "checkpoint_step": 7, "token": "x", "layout_digest": d, **kw}
        )
    sessionless_cases(e, unary, out)
    return out


def sessionless_cases(e: Env, unary, out: Dict[str, List[Case]]) -> None:
    """Calls that would change the live job, but without trainer 0's session: all must be refused.

    What a port scanner, a health checker pointed at the wrong port or a misconfigured client
    sends: empty bytes to Close, a well-formed push for the current step, ... Also a Hello
    from a second process for a trainer id whose process is alive, and one without an incarnation.
    """
    d = e.digest
    out["Close"].append(Case("hand-made: empty bytes (Close of trainer 0, no session)", [b""], refuse=True))
    for desc, token in (
        ("no session", ""),
        ("a made-up session", "0123456789abcdef" * 2),
        ("trainer 1's session", e.sessions[1]),
        ("its session in upper case", e.sessions[0].upper()),
    ):
        for name, chunk in (("PushPull", STREAM_CHUNK), ("PushPullOne", ONE_MESSAGE)):
            out[name].append(
                Case(
                    f"hand-made: a valid push of trainer 0 for the current step, {desc}",
                    push_stream(e, chunk, step=0, session=token),
                    refuse=True,
                )
            )
        for name, chunk in (("Prefetch", PREFETCH_CHUNK), ("PrefetchOne", ONE_MESSAGE)):
            out[name].append(
                Case(
                    f"hand-made: a valid prefetch of trainer 0, {desc}",
                    prefetch_stream(e, chunk, session=token),
                    refuse=True,
                )
            )
        unary("Close", f"Close of live trainer 0, {desc}", trainer_id=0, session=token)
        unary("Heartbeat", f"heartbeat of trainer 0, {desc}", trainer_id=0, session=token)
        unary(
            "Pull",
            f"pull of trainer 0, {desc}",
            trainer_id=0,
            names=sorted(e.blocks),
            layout_digest=d,
            session=token,
        )
        unary(
            "Checkpoint",
            f"checkpoint asked for trainer 0, {desc}",
            trainer_id=0,
            layout_digest=d,
            session=token,
        )
        unary(
            "SaveTables",
            f"SaveTables asked for trainer 0, {desc}",
            trainer_id=0,
            directory=str(e.tmp / "stray"),
            layout_digest=d,
            session=token,
        )
        unary(
            "Restore",
            f"roll-back asked for trainer 0, {desc}",
            trainer_id=0,
            checkpoint_step=0,
            token="stray",
            layout_digest=d,
            session=token,
        )
    unary("Hello", "a second process for live trainer 0", trainer_id=0, layout_digest=d, incarnation=12345)
    unary(
        "Hello", "a second process for live trainer 1", trainer_id=1, layout_digest=d, incarnation=2**64 - 1
    )
    unary("Hello", "no incarnation", trainer_id=0, layout_digest=d)


def split_into_other_tensor(ms) -> None:
    """Cut the first piece's data in two; name the second half after another tensor (bag@ids)."""
    first = ms[0].pieces[0]
    half = len(first.data) // 2 // 8 * 8
    second = ps_pb2.TensorPiece(
        name="bag@ids",
        dtype="int64",
        shape=[(len(first.data) - half) // 8],
        offset=half,
        data=first.data[half:],
    )
    first.data = first.data[:half]
    ms[0].pieces.insert(1, second)
