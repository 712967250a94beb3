"""The pserver's gRPC options: how long, and how many, arrived calls may wait for the server to take them up.

gRPC cancels a call that reached a server and was not taken up by it (a
RequestCall) within ``grpc.server_max_unrequested_time_in_server`` (default
30 s), and rejects arriving calls while more than ``grpc.server.max_pending_requests``
(default 1,000; all past 3,000) wait: either way the client sees CANCELLED
"CANCELLED" and the servicer never sees the call. A pserver whose event loop
takes up a thousand trainers' pushes one per turn passes both;
``server_options(queue_s=..., trainers=...)`` sets them (the pserver: its
trainers' own deadline for a call, and its trainers).
"""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from psproto.options import (
    CALLS_PER_TRAINER,
    FAST_KEEPALIVE_MS,
    channel_options,
    pending_call_limits,
    server_options,
)

QUEUE = "grpc.server_max_unrequested_time_in_server"


@pytest.mark.parametrize("fast_keepalive, queue_s", [(False, 600), (True, 600), (False, 1), (True, 3600)])
def test_server_options_carry_the_queue_limit_and_keep_keepalive(fast_keepalive, queue_s):
    options = dict(server_options(1 << 20, fast_keepalive=fast_keepalive, queue_s=queue_s))
    assert options[QUEUE] == queue_s
    # Hot standby's fast keepalive is what it was: pings accepted every FAST_KEEPALIVE_MS / 2, no strikes.
    want_ping_interval = FAST_KEEPALIVE_MS // 2 if fast_keepalive else 10_000
    assert options["grpc.http2.min_ping_interval_without_data_ms"] == want_ping_interval
    assert ("grpc.http2.max_ping_strikes" in options) == fast_keepalive


@pytest.mark.parametrize(
    "fast_keepalive, time_ms, timeout_ms",
    [(False, 30_000, 20_000), (True, FAST_KEEPALIVE_MS, FAST_KEEPALIVE_MS)],
)
def test_channel_keepalive_unchanged(fast_keepalive, time_ms, timeout_ms):
    options = dict(channel_options(1 << 20, fast_keepalive=fast_keepalive))
    assert (options["grpc.keepalive_time_ms"], options["grpc.keepalive_timeout_ms"]) == (time_ms, timeout_ms)


PENDING = ("grpc.server.max_pending_requests", "grpc.server.max_pending_requests_hard_limit")


@pytest.mark.parametrize(
    "trainers, soft, hard",
    [
        (0, 1_000, 3_000),  # gRPC's own limits are the floor
        (1, 1_000, 3_000),
        (125, 1_000, 3_000),  # 125 x 8 = 1,000: still gRPC's
        (126, 1_008, 3_024),
        (1_024, 8_192, 24_576),  # a thousand trainers: all their calls may wait at once
    ],
)
def test_pending_call_limits_cover_every_trainer_s_calls(trainers, soft, hard):
    assert pending_call_limits(trainers) == (soft, hard)
    assert soft >= CALLS_PER_TRAINER * trainers and hard == max(3_000, 3 * soft)
    options = dict(server_options(1 << 20, trainers=trainers))
    assert (options[PENDING[0]], options[PENDING[1]]) == (soft, hard)


def test_pending_call_limits_refuse_negative_trainers():
    with pytest.raises(ValueError, match="trainers must be >= 0"):
        pending_call_limits(-1)


def _calls_behind_a_blocked_loop(queue_s: int, block_s: float, behind: int = 4, options=None):
    """Outcomes of ``behind`` calls sent while the server's event loop is blocked ``block_s`` s by a first
    call.

    The server's options: ``options`` if given, else ``server_options(queue_s=queue_s)``.
    """

    async def handler(request, context):
        if request == b"block":
            time.sleep(block_s)  # blocks the event loop: no arrived call is taken up meanwhile
        return b"ok"

    generic = grpc.method_handlers_generic_handler("t", {"m": grpc.unary_unary_rpc_method_handler(handler)})
    ready, stop, port = threading.Event(), None, []
    loop = asyncio.new_event_loop()

    async def serve():
        nonlocal stop
        server = grpc.aio.server(options=options or server_options(1 << 20, queue_s=queue_s))
        server.add_generic_rpc_handlers((generic,))
        port.append(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        stop = asyncio.Event()
        ready.set()
        await stop.wait()
        await server.stop(0)

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(10), "the server did not start"
    channel = grpc.insecure_channel(f"127.0.0.1:{port[0]}")
    try:
        method = channel.unary_unary("/t/m")
        first = method.future(b"block", timeout=30)
        time.sleep(0.3)  # the first call is being handled: the loop is blocked
        later = [method.future(b"x", timeout=30) for _ in range(behind)]
        outcomes = []
        for f in later:
            try:
                outcomes.append(f.result())
            except grpc.RpcError as e:
                outcomes.append(e.code())
        assert first.result() == b"ok"
        return outcomes
    finally:
        channel.close()
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)


def test_a_call_waiting_past_the_limit_is_cancelled():
    # The limit is what gRPC applies: with 1 s, calls queued behind a loop blocked 3 s are cancelled
    # (the first after the block may be taken up by the request the server had already posted).
    outcomes = _calls_behind_a_blocked_loop(queue_s=1, block_s=3.0)
    assert outcomes.count(grpc.StatusCode.CANCELLED) >= len(outcomes) - 1, outcomes


def test_a_call_within_the_limit_is_served():
    outcomes = _calls_behind_a_blocked_loop(queue_s=10, block_s=3.0)
    assert outcomes == [b"ok"] * len(outcomes)


def _outcome_counts(options, behind: int):
    outcomes = _calls_behind_a_blocked_loop(queue_s=600, block_s=2.0, behind=behind, options=options)
    return {o if isinstance(o, grpc.StatusCode) else "ok": outcomes.count(o) for o in set(outcomes)}


def test_grpc_sheds_calls_past_its_pending_limit_and_a_pserver_of_that_many_trainers_does_not():
    # 2,000 calls waiting behind a blocked loop: past gRPC's 1,000 it rejects arrivals at random
    # (each with odds (waiting - 1,000) / 2,000; about 160 here, none only with odds below 1e-60).
    grpc_limits = [o for o in server_options(1 << 20, queue_s=600) if o[0] not in PENDING]
    shed = _outcome_counts(grpc_limits, behind=2_000)
    assert shed.get(grpc.StatusCode.CANCELLED, 0) > 0 and set(shed) == {"ok", grpc.StatusCode.CANCELLED}, shed
    # A pserver of 250 trainers lets 2,000 (8 each) wait: every one is served.
    assert _outcome_counts(server_options(1 << 20, queue_s=600, trainers=250), behind=2_000) == {"ok": 2_000}
