"""How connections are made: the gRPC options of pserver servers and trainer channels.

Both sides bound messages by the chunk size the plan chose (see
:func:`psproto.codec.message_limit`); securing them (token, TLS) is
:mod:`psproto.security`.
"""

from __future__ import annotations

from .codec import message_limit


def _message_limits(chunk_bytes: int) -> list:
    limit = message_limit(chunk_bytes)
    return [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]


# Hot standby: how often a trainer (or a primary) pings a replicated pserver's connection while a call
# waits on it, and how long an answer may take. A process cut off by the network sends no reset; this
# tells its peers within about two seconds instead of TCP's twenty, so they ask who leads instead.
FAST_KEEPALIVE_MS = 1_000


# Calls one trainer may have waiting at one pserver at once: a step call (push-pull, pull or prefetch) per
# local rank of its node (each looks up its own batch's rows; nodes of up to 8 GPUs) or, on one process,
# a step's and the next one's (the pipelined stepper), a heartbeat (at most one, trainer/heartbeat.py)
# and control calls (Hello, Close, Reduce, Stats, Checkpoint, ...).
CALLS_PER_TRAINER = 8
# gRPC's own limits on calls waiting to be taken up (``grpc.server.max_pending_requests`` and its hard
# limit): the floor of a pserver's.
GRPC_PENDING_SOFT, GRPC_PENDING_HARD = 1_000, 3_000


def pending_call_limits(trainers: int) -> tuple:
    """(soft, hard) limits on the calls a pserver of ``trainers`` trainers lets wait to be taken up.

    Past the soft limit gRPC rejects arriving calls at random, more the closer the queue is to the
    hard limit, and every one past the hard limit; a rejected call ends CANCELLED "CANCELLED", unseen
    by the servicer, and its trainer takes the pserver for down. A job within its bounds never gets
    there: the soft limit is what all trainers may have waiting at once (:data:`CALLS_PER_TRAINER`
    each), gRPC's 1,000 at least; the hard one keeps gRPC's ratio of 3. So only a job past its bounds
    (trainers that do not wait for their answers) is shed, and a pserver's queue stays bounded.
    """
    if trainers < 0:
        raise ValueError(f"trainers must be >= 0, not {trainers}")
    soft = max(GRPC_PENDING_SOFT, CALLS_PER_TRAINER * trainers)
    return soft, max(GRPC_PENDING_HARD, 3 * soft)


def server_options(
    chunk_bytes: int, fast_keepalive: bool = False, queue_s: int = 600, trainers: int = 0
) -> list:
    """gRPC options of a pserver: bounded messages, no port sharing, tolerant keepalive, a patient queue.

    ``queue_s``: how long a call that reached the server may wait to be taken up by it (gRPC's
    default, 30 s, cancels it CANCELLED, unseen by the servicer); the pserver passes its trainers'
    own deadline for a call, so a call is given up by its trainer, not by the queue.
    ``trainers``: how many calls may wait to be taken up at once (:func:`pending_call_limits`).
    ``fast_keepalive`` (hot standby) accepts pings every :data:`FAST_KEEPALIVE_MS` / 2 ms, even
    while a call waits without data (a sync barrier), instead of answering them with GOAWAY.
    """
    return [
        *_message_limits(chunk_bytes),
        # Off so a second pserver on the same port fails to bind instead of
        # silently sharing it.
        ("grpc.so_reuseport", 0),
        (
            "grpc.http2.min_ping_interval_without_data_ms",
            FAST_KEEPALIVE_MS // 2 if fast_keepalive else 10_000,
        ),
        ("grpc.keepalive_permit_without_calls", 1),
        *([("grpc.http2.max_ping_strikes", 0)] if fast_keepalive else []),
        # The asyncio server takes up arrived calls one per turn of its event loop: a thousand trainers
        # pushing at once on a busy pserver queue longer than gRPC's 30 s (tests/proto/test_options.py).
        ("grpc.server_max_unrequested_time_in_server", queue_s),
        # ... and a thousand trainers' pushes plus their heartbeats outnumber gRPC's 1,000 waiting calls.
        *zip(
            ("grpc.server.max_pending_requests", "grpc.server.max_pending_requests_hard_limit"),
            pending_call_limits(trainers),
        ),
    ]


def channel_options(chunk_bytes: int, fast_keepalive: bool = False) -> list:
    """gRPC options of a trainer's channel to a pserver: bounded messages, keepalive, fast reconnects.

    ``fast_keepalive`` (hot standby): ping every :data:`FAST_KEEPALIVE_MS` and give up on a
    connection whose ping is not answered within as long.
    """
    return [
        *_message_limits(chunk_bytes),
        ("grpc.keepalive_time_ms", FAST_KEEPALIVE_MS if fast_keepalive else 30_000),
        ("grpc.keepalive_timeout_ms", FAST_KEEPALIVE_MS if fast_keepalive else 20_000),
        # Each pserver gets its own connection even when endpoints share a host.
        ("grpc.use_local_subchannel_pool", 1),
        # A trainer that starts before its pservers retries within ~0.1 s of them
        # binding, not after gRPC's default 1 s backoff: a head start of one
        # trainer over another costs async training (stale, doubled updates at join).
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]
