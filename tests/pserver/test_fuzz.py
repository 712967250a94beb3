"""Fuzzing every RPC of a pserver: bad bytes get a clear status, and change nothing.

A sync pserver (2 trainers, ``barrier_timeout`` 2 s) holds dense blocks and a shard of two distributed
tables; the live job on it is one Trainer per id, joined and heartbeating, whose sessions the valid base
requests carry. Every method of the ParameterServer service, enumerated from the proto descriptor so that
methods added later are covered too, gets a seeded, deterministic series of requests over a raw channel
(bytes in, bytes out):

- empty bytes, random bytes (0..4096), protobuf-shaped garbage, random tensor pieces;
- byte-level mutations of a VALID base request (bit flips, byte replacement, truncation, insertion,
  deletion, splices with another method's base);
- wire-level mutations (overlong varints, declared lengths too long or short, huge lengths, wrong wire
  types and field numbers, duplicated, dropped or unknown fields);
- typed mutations (trainer ids out of range, steps from the future or the past, extreme versions, huge or
  negative shapes, offsets, wrong dtypes, unknown names, short or long data, NaN/Inf);
- hand-made bad requests that MUST be refused (``Case.refuse``), many of them for the current step, so that
  accepting one would show up as a state change; among them every state-changing call without the trainer's
  session (an empty Close, a well-formed push for the current step with no, a made-up or another trainer's
  session) and a second process's Hello for a live trainer id;
- for client streams: garbage after a valid header, duplicated headers, pieces before the header, out of
  order, overlapping or missing, streams cut short.

Every answer must be OK or a refusal with a message: never UNKNOWN or INTERNAL (gRPC's answer to an
unhandled exception: a stack trace instead of a clear message), never a client-side deadline (a hang; the
pserver's own DEADLINE_EXCEEDED naming the trainers a barrier waits for is a refusal), never UNIMPLEMENTED
but from PushPullShared, whose refusal of regions it cannot map is UNIMPLEMENTED naming the pserver (a
trainer then sends bytes). After each request the pserver's state is checked (version, pending pushes,
closed trainers, table rows, block bytes); at the end it must still answer Stats, Hello and Pull with
bit-identical blocks, have logged no traceback, and the live job's two trainers, untouched by it all, must
train a real sync step.

The bases (``fuzz_cases.base_requests``) are requests the pserver must refuse or that cannot change state
even when valid, e.g. pushes for step 5 while the pserver is at step 0. The rare mutation that turns into a
request that may legitimately change state (a push for the current step, a Close of a live trainer, ...) is
skipped (``fuzz_cases.legit_change``). A failure names the method, the case (seed, number, description) and
the input in hex. ``PS_FUZZ_SCALE=10 PS_FUZZ_SEED=7 pytest tests/pserver/test_fuzz.py`` runs a deeper,
different series.

The cases come from fuzz_cases (the setup and the bases), fuzz_series (the generated series), fuzz_crafted
(the hand-made ones) and fuzz_wire (protobuf wire-level mutations); this module runs the pserver and sends
them, and fuzz_judge's raw calls and judges read the answers and the state.

test_codec_decodes_like_protobuf also decodes every fuzzed chunk message with psproto.codec and with the
generated protobuf classes: the hand-written decoder must not accept what protobuf refuses, nor read
anything differently, nor refuse what protobuf reads except a group (the one thing it is documented to be
stricter about); every base message and most fuzzed ones protobuf reads must decode identically.
"""

from __future__ import annotations

import logging
import os
import random
import re
import time
from collections import Counter

import grpc
import numpy as np
import pytest
from google.protobuf.message_factory import GetMessageClass

from harness.cluster import LocalCluster
from psproto.codec import WireError, as_bytes, decode_chunk
from tests.helpers.fuzz_cases import (
    METHODS,
    TRAINERS,
    build,
    close_env,
    legit_change,
    make_env,
    train_one_step,
)
from tests.helpers.fuzz_crafted import crafted_cases
from tests.helpers.fuzz_judge import (
    CALL_TIMEOUT,
    invoke,
    judge,
    pull_blocks,
    show,
    state_change,
    stats,
    tracebacks,
)
from tests.helpers.fuzz_series import generate_cases
from tests.helpers.fuzz_wire import varint
from transpiler import DistributeTranspilerConfig

# PS_FUZZ_SEED: another seed, for a different series (PS_FUZZ_SCALE, in fuzz_series: a longer one).
SEED = int(os.environ.get("PS_FUZZ_SEED", "20240611"))
BARRIER_TIMEOUT = 2.0


# -- the cluster ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    # A checkpoint directory (empty: nothing to resume) makes Restore and Checkpoint reach the engine.
    # A long heartbeat_timeout: a trainer a fuzzed Hello joined is not dropped during a long run.
    config = DistributeTranspilerConfig(
        barrier_timeout=BARRIER_TIMEOUT, checkpoint_dir=str(tmp / "checkpoints"), heartbeat_timeout=3600.0
    )
    with LocalCluster(build, 2, TRAINERS, config=config) as cluster:
        # The live job: both trainers joined (step 0) and heartbeating while the fuzzing runs.
        trainers = [cluster.trainer(t) for t in range(TRAINERS)]
        e = None
        try:
            with grpc.insecure_channel(cluster.endpoints[0]) as channel:
                e = make_env(cluster, channel, tmp, trainers, SEED)
                e.crafted = crafted_cases(e)
                version, e.before = pull_blocks(e)
                assert version == 0
                yield e
        finally:
            for tr in trainers:
                tr.close()
            if e is not None:
                close_env(e)


# -- tests ------------------------------------------------------------------------------------


def test_every_method_has_a_base_request(env):
    missing = [name for name in METHODS if name not in env.bases]
    assert not missing, (
        f"RPCs without a base request in tests/fuzz_cases.py: {missing}; add a valid request "
        f"for each to base_requests() (one the pserver must refuse, or that cannot change "
        f"its state) so that it gets fuzzed"
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(METHODS))
def test_fuzz_rpc(env, name, caplog):
    if name not in env.bases:
        pytest.fail(
            f"RPC {name} has no base request: add one to base_requests() in tests/fuzz_cases.py "
            f"(a valid request the pserver must refuse, or that cannot change its state)"
        )
    method = METHODS[name]
    problem = state_change(env)
    assert problem is None, (
        f"the pserver's state changed before fuzzing {name} (by an earlier test): {problem}"
    )
    cases = generate_cases(env, name, random.Random(f"{SEED}:{name}"))
    failures, codes, skipped = [], Counter(), []
    start = time.monotonic()
    for number, case in enumerate(cases):
        why = legit_change(env, name, case.messages)
        if why is not None and not case.refuse:
            skipped.append(f"#{number} {case.desc}: {why}")
            continue
        code, details, replies = invoke(env.channel, method, case.messages)
        codes[code.name] += 1
        label = f"{name} case #{number} (seed {SEED}) {case.desc}"
        wrong = judge(method, case, code, details, replies)
        if wrong is not None:
            failures.append(
                f"{label}: {wrong}; status {code.name} {details[:300]!r}; input {show(case.messages)}"
            )
        changed = state_change(env)
        if changed is not None:
            failures.append(
                f"{label} CHANGED THE PSERVER'S STATE: {changed}; status {code.name} "
                f"{details[:200]!r}; input {show(case.messages)}"
            )
            break  # later cases would only report the same change
    elapsed = time.monotonic() - start
    failures += tracebacks(caplog)
    summary = (
        f"{name}: {len(cases)} cases, {len(skipped)} skipped as legitimately state-changing, "
        f"{elapsed:.1f}s, answers {dict(codes)}"
    )
    logging.getLogger(__name__).info(summary)
    if failures:
        pytest.fail(
            f"{summary}\n{len(failures)} failures:\n"
            + "\n".join(failures[:60])
            + (f"\n... {len(failures) - 60} more" if len(failures) > 60 else ""),
            pytrace=False,
        )


@pytest.mark.timeout(120)
def test_after_fuzzing_the_pserver_is_unchanged_and_trains(env, caplog):
    """Runs after the fuzzing (module order): same state, still serving, a real sync step works."""
    reply = stats(env)
    assert reply.step == 0 and reply.table_rows == 0, reply
    assert sorted(reply.trainers_alive) == list(range(TRAINERS)) and not reply.trainers_dropped, reply
    # The live trainer's own process says Hello again (as a re-sync does): same session, same step.
    hello = env.trainers[0].channels.hello(CALL_TIMEOUT)[env.cluster.endpoints[0]]
    assert hello.start_step == 0 and hello.sync_mode and hello.trainers == TRAINERS
    assert hello.session == env.sessions[0]
    version, blocks = pull_blocks(env)
    assert version == 0
    assert blocks.keys() == env.before.keys()
    changed = [n for n in blocks if blocks[n] != env.before[n]]
    assert not changed, f"blocks changed by the fuzzing: {changed}"
    assert state_change(env) is None, state_change(env)

    losses = train_one_step(env)
    assert sorted(losses) == [0, 1] and all(np.isfinite(list(losses.values())))
    for server in env.cluster.servers:
        assert server.engine.step == 1, server.endpoint
    assert stats(env).table_rows > 0
    moved = {n: b.detach().clone() for n, b in env.server.engine.store.blocks.items()}
    assert any(as_bytes(moved[n]).tobytes() != env.before[n] for n in moved), "the sync step changed nothing"
    assert not tracebacks(caplog), tracebacks(caplog)


# What psproto.codec refuses although protobuf reads it: a group (wire type 3, deprecated
# since proto2), which no message of ps.proto holds and protobuf skips as an unknown field
# (psproto.codec.chunks._fields). A refusal of a message protobuf reads for any other reason is a codec bug.
STRICTER_THAN_PROTOBUF = re.compile(r"unsupported protobuf wire type 3 \(field \d+\)")


def test_codec_decodes_like_protobuf(env):
    """psproto.codec's hand-written decoder against the generated classes, on every fuzzed message."""
    differences, checked = [], set()
    bases = identical = stricter = 0
    for name, method in METHODS.items():
        cls = GetMessageClass(method.input_type)
        if "pieces" not in cls.DESCRIPTOR.fields_by_name:
            continue
        assert name in env.bases, f"chunked method {name} has no base request"
        header_cls = GetMessageClass(cls.DESCRIPTOR.fields_by_name["header"].message_type)

        def compare(label: str, data: bytes) -> str:
            """'same', 'stricter' (a group), 'refused by both', or a difference is recorded."""
            try:
                reference = cls.FromString(data)
            except Exception:  # noqa: BLE001
                reference = None
            try:
                header, pieces = decode_chunk(data, header_cls)
                refusal = None
            except WireError as e:
                refusal = str(e)
            except Exception as e:  # noqa: BLE001
                differences.append(f"{label}: the codec raised {e!r}, not a WireError")
                return "different"
            if reference is None:
                if refusal is None:
                    differences.append(f"{label}: protobuf refuses it, the codec decodes it")
                    return "different"
                return "refused by both"
            if refusal is not None:
                if STRICTER_THAN_PROTOBUF.fullmatch(refusal):
                    return "stricter"
                differences.append(f"{label}: protobuf reads it, the codec refuses it: {refusal!r}")
                return "different"
            want = [(p.name, p.dtype, tuple(p.shape), p.offset, p.data) for p in reference.pieces]
            got = [(p.name, p.dtype, tuple(p.shape), p.offset, bytes(p.data)) for p in pieces]
            want_header = reference.header if reference.HasField("header") else None
            if header != want_header or got != want:
                differences.append(
                    f"{label}: decoded differently (header {header} vs {want_header}; "
                    f"pieces equal: {got == want})"
                )
                return "different"
            return "same"

        # Every message of every valid base request (what a pserver really receives) decodes the same.
        for i, data in enumerate(env.bases[name]):
            checked.add(data)
            verdict = compare(f"{name} base message {i}: {show([data])}", data)
            assert verdict == "same", f"{name} base message {i}: {verdict}\n" + "\n".join(differences[-1:])
        decoded = [decode_chunk(data, header_cls) for data in env.bases[name]]
        assert decoded[0][0] is not None, f"{name}: the base opens without a header"
        assert sum(len(pieces) for _, pieces in decoded) >= 2, f"{name}: the base carries no tensors"
        bases += len(decoded)
        # The one refusal allowed above, as the codec words it: an empty group of field 9 appended.
        grouped = env.bases[name][0] + varint(9 << 3 | 3) + varint(9 << 3 | 4)
        assert compare(f"{name} base message 0 + a group", grouped) == "stricter", differences[-1:]
        assert (
            str(pytest.raises(WireError, decode_chunk, grouped, header_cls).value)
            == "unsupported protobuf wire type 3 (field 9)"
        )
        for number, case in enumerate(generate_cases(env, name, random.Random(f"{SEED}:{name}"))):
            for data in case.messages:
                if data in checked:
                    continue
                checked.add(data)
                verdict = compare(f"{name} case #{number} {case.desc}: {show([data])}", data)
                identical += verdict == "same"
                stricter += verdict == "stricter"
    assert not differences, f"{len(differences)} differences:\n" + "\n".join(differences[:30])
    assert bases >= 5, f"only {bases} base messages of chunked methods"
    # Refusing only groups is not refusing much: most fuzzed messages protobuf reads (a byte flip
    # in tensor data, a typed mutation, ...) must decode, and the same.
    accepted = identical + stricter
    assert accepted >= 200 and identical >= 0.9 * accepted, (
        f"of {accepted} fuzzed messages protobuf reads, the codec decodes {identical} identically and "
        "refuses "
        f"{stricter} (groups)"
    )
