"""The series of cases fuzzing a pserver's data channel (tests/data/test_data_fuzz.py), seeded and
deterministic: bytes before or instead of a hello, hellos the pserver must refuse, request headers,
push-pulls (for step 5: the pserver is at step 0, so none may count) written by the trainer's own payload
writer and then mutated or cut short, shared-memory calls, prefetches and pulls. ``PS_FUZZ_SCALE`` makes the
generated part longer. Each series is a function of the pserver under fuzz (fuzz_data's
:class:`~tests.helpers.fuzz_data.DataFuzz`) and a seeded ``random.Random``. Here the calls' series and
:data:`SERIES`, all of them; those that stop before a call is served are in
:mod:`tests.helpers.fuzz_data_frames`, the mutations in :mod:`tests.helpers.fuzz_data_mutations`.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Callable, Dict, List

import numpy as np
import torch

from psproto.dataplane.frames import (
    DROPPED,
    MAP_REGIONS,
    PREFETCH,
    PULL,
    SHARED,
    RequestHeader,
    pack_regions,
)
from psproto.dataplane.payload import TableCounts
from psproto.shared_memory import NAME_PREFIX

from .fuzz_data import (
    DEADLINE_EXCEEDED,
    FAILED_PRECONDITION,
    INVALID_ARGUMENT,
    SCALE,
    UNIMPLEMENTED,
    DataCase,
    DataFuzz,
    push_header,
    request,
)
from .fuzz_data_frames import bad_headers, before_hello, refused_hellos
from .fuzz_data_mutations import Mutations, extend, flip_bits, set_bytes, truncate

N_PUSHES, N_CUTS, N_PREFETCHES = 300 * SCALE, 30 * SCALE, 60 * SCALE


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
    mutations = [(Mutations(push, d.payloads), push, payload, what) for push, payload, what in bases]
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
        done = rng.choice((flip_bits, set_bytes, truncate, extend))(p, rng)
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
