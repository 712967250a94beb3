"""Fuzzing a pserver's data channel: bad bytes on its data port get a refusal or a close, and change nothing.

The pserver is tests/pserver/test_fuzz.py's (a sync pserver of 2, ``barrier_timeout`` 2 s, dense blocks
and a shard of two distributed tables; the live job's two trainers joined and heartbeating), run with an
auth token so that the token check is fuzzed too. Raw connections to its data port send seeded,
deterministic series of bad input (tests/helpers/fuzz_data_series.py): bytes before or instead of a
hello, hellos cut short or with bad fields, hellos that parse but must be refused (token, session, digest,
trainer id), and after a valid hello of trainer 0 (its live session) bad request headers, push-pulls for
step 5 (the pserver is at step 0) written by the trainer's own payload writer and then mutated or cut
short, shared-memory calls with no regions, regions that cannot be mapped or too small an answer region,
prefetches of the other shard's ids.

Every case must end within the timeout with refusals (a status other than OK, INTERNAL or UNKNOWN, with a
message) or the connection closed (tests/helpers/fuzz_data.py judges); no traceback may be logged and the
pserver's state must not change (tests/helpers/fuzz_judge.py's ``state_change``). A failure names the
series, the case (seed, number, description) and its bytes in hex. At the end a fresh valid connection
pulls bit-identical blocks and the live job trains a real sync step.
``PS_FUZZ_SCALE=10 PS_FUZZ_SEED=7 pytest tests/data/test_data_fuzz.py`` runs a longer, different series.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections import Counter
from typing import List

import numpy as np
import pytest

from harness.cluster import LocalCluster
from psproto.codec import as_bytes
from psproto.dataplane.frames import OK, PULL, FrameError, RequestHeader
from psproto.security import Security
from tests.helpers.fuzz_cases import TRAINERS, build, close_env, make_env, train_one_step
from tests.helpers.fuzz_data import CODES, DataFuzz, answers, exchange, judge, show
from tests.helpers.fuzz_data_series import SERIES
from tests.helpers.fuzz_judge import pull_blocks, state_change, tracebacks
from transpiler import DistributeTranspilerConfig

# PS_FUZZ_SEED: another seed, for a different series (PS_FUZZ_SCALE, in fuzz_data_series: a longer one).
SEED = int(os.environ.get("PS_FUZZ_SEED", "20240611"))
BARRIER_TIMEOUT = 2.0
TOKEN = "data-channel-fuzz-token"


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("data-fuzz")
    # A long heartbeat_timeout: no live trainer is dropped however long a deeper run takes.
    config = DistributeTranspilerConfig(barrier_timeout=BARRIER_TIMEOUT, heartbeat_timeout=3600.0)
    security = Security(token=TOKEN)
    with LocalCluster(build, 2, TRAINERS, config=config, security=security) as cluster:
        trainers = [cluster.trainer(t) for t in range(TRAINERS)]  # joined, heartbeating
        e = d = None
        try:
            with security.channel(cluster.endpoints[0]) as channel:
                e = make_env(cluster, channel, tmp, trainers, SEED)
                version, e.before = pull_blocks(e)
                assert version == 0
                d = DataFuzz.of(e, TOKEN)
                yield d
        finally:
            for tr in trainers:
                tr.close()
            if d is not None:
                d.close()
            if e is not None:
                close_env(e)


def answered(received: bytes) -> List[str]:
    """The statuses of the whole answer frames in ``received``, by name."""
    try:
        return [CODES.get(a.header.status, str(a.header.status)) for a in answers(received)[0]]
    except FrameError:
        return ["(not a frame)"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("series", list(SERIES))
def test_fuzz_data_channel(fuzz, series, caplog):
    problem = state_change(fuzz.env)
    assert problem is None, f"the pserver's state changed before the series {series}: {problem}"
    cases = SERIES[series](fuzz, random.Random(f"{SEED}:{series}"))
    failures, endings, statuses = [], Counter(), Counter()
    start = time.monotonic()
    for number, case in enumerate(cases):
        received, ended = exchange(fuzz.port, case.data, case.wait)
        endings[ended] += 1
        statuses.update(answered(received))
        label = f"{series} case #{number} (seed {SEED}) {case.desc}"
        wrong = judge(case, received, ended)
        if wrong is not None:
            failures.append(f"{label}: {wrong}; input {show(case)}; answer {received[:48].hex()}")
        changed = state_change(fuzz.env)
        if changed is not None:
            failures.append(f"{label} CHANGED THE PSERVER'S STATE: {changed}; input {show(case)}")
            break  # later cases would only report the same change
    failures += tracebacks(caplog)
    summary = (
        f"{series}: {len(cases)} cases, {time.monotonic() - start:.1f}s, ended {dict(endings)}, "
        f"answers {dict(statuses)}"
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
def test_after_fuzzing_the_data_channel_serves_and_the_job_trains(fuzz, caplog):
    """Runs after the fuzzing (module order): a valid connection pulls the same blocks; a real step works."""
    env = fuzz.env
    received, ended = exchange(fuzz.port, fuzz.hello() + RequestHeader(PULL).pack())
    frames, left = answers(received)
    assert ended == "closed" and not left and len(frames) == 2, (ended, left, [str(f) for f in frames])
    hello, pull = frames
    assert hello.header.status == OK and pull.header.status == OK, (str(hello), str(pull))
    assert pull.header.step == 0
    lane = fuzz.payloads.lane(1, 0)
    assert pull.header.payload_bytes == lane.layout.nbytes and sorted(lane.names) == sorted(env.before)
    for name, offset in zip(lane.names, lane.layout.offsets):
        want = env.before[name]
        assert pull.payload[offset : offset + len(want)] == want, f"block {name} changed by the fuzzing"
    assert state_change(env) is None, state_change(env)

    losses = train_one_step(env)
    assert sorted(losses) == list(range(TRAINERS)) and all(np.isfinite(list(losses.values())))
    for server in env.cluster.servers:
        assert server.engine.step == 1, server.endpoint
    moved = {n: as_bytes(b).tobytes() for n, b in env.server.engine.store.blocks.items()}
    assert any(moved[n] != env.before[n] for n in moved), "the sync step changed nothing"
    assert not tracebacks(caplog), tracebacks(caplog)
