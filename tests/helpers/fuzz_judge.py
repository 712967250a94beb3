"""Raw calls to the pserver under fuzz, and the judging of its answers and its state
(tests/pserver/test_fuzz.py).

:func:`invoke` sends a method's raw messages and returns what came back; :func:`judge` says what is wrong
with an answer (an unhandled exception, a hang, an acceptance of what must be refused, a reply that does
not decode); :func:`state_change` what changed in the pserver since fuzzing began.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional, Tuple

import grpc
from google.protobuf.message_factory import GetMessageClass

from psproto import ps_pb2
from psproto.codec import TensorReader, as_bytes, decode_chunk
from tests.helpers.fuzz_cases import SERVICE, Case, Env

CALL_TIMEOUT = 4.0  # per call; longer than the barrier, so a barrier refusal is not a hang


def path_of(name: str) -> str:
    return f"/{SERVICE.full_name}/{name}"


def invoke(channel: grpc.Channel, method, messages: List[bytes]):
    """Call ``method`` with raw ``messages``; (status code, details, raw replies)."""
    kinds = {
        (False, False): channel.unary_unary,
        (False, True): channel.unary_stream,
        (True, False): channel.stream_unary,
        (True, True): channel.stream_stream,
    }
    call = kinds[method.client_streaming, method.server_streaming](path_of(method.name))
    request = iter(list(messages)) if method.client_streaming else messages[0]
    try:
        if method.server_streaming:
            replies = list(call(request, timeout=CALL_TIMEOUT))
        else:
            replies = [call(request, timeout=CALL_TIMEOUT)]
    except grpc.RpcError as e:
        return e.code(), e.details() or "", []
    return grpc.StatusCode.OK, "", replies


def pull_blocks(env: Env) -> Tuple[int, Dict[str, bytes]]:
    """(version, {block: raw bytes}) of this pserver's blocks, by a valid Pull."""
    request = ps_pb2.PullRequest(
        trainer_id=0,
        min_step=0,
        names=sorted(env.blocks),
        layout_digest=env.digest,
        session=env.sessions[0],
    ).SerializeToString()
    reader, version = TensorReader(lambda n: env.blocks.get(n)), None
    for data in env.channel.unary_stream(path_of("Pull"))(request, timeout=CALL_TIMEOUT):
        header, pieces = decode_chunk(data, ps_pb2.PullHeader)
        if header is not None:
            version = header.step
        for piece in pieces:
            reader.add(piece)
    return version, {n: as_bytes(t).tobytes() for n, t in reader.finish().items()}


def stats(env: Env) -> ps_pb2.StatsReply:
    raw = env.channel.unary_unary(path_of("Stats"))(b"", timeout=CALL_TIMEOUT)
    return ps_pb2.StatsReply.FromString(raw)


# -- judging --------------------------------------------------------------------------------

BAD_CODES = {
    grpc.StatusCode.UNKNOWN: (
        "UNKNOWN: an unhandled exception in the handler (a stack trace, not a clear refusal)"
    ),
    grpc.StatusCode.INTERNAL: "INTERNAL: the server failed internally",
    grpc.StatusCode.UNAVAILABLE: "UNAVAILABLE: the pserver stopped answering",
    grpc.StatusCode.CANCELLED: "CANCELLED",
    grpc.StatusCode.DATA_LOSS: "DATA_LOSS",
    grpc.StatusCode.UNIMPLEMENTED: "UNIMPLEMENTED: the method is not registered",
}


def judge(method, case: Case, code, details: str, replies: List[bytes]) -> Optional[str]:
    """What is wrong with an answer, or None."""
    if code == grpc.StatusCode.OK:
        if case.refuse:
            return "accepted, but this request must be refused"
        try:
            if method.server_streaming:
                headers = [decode_chunk(r, ps_pb2.PullHeader)[0] for r in replies]
                if not headers or headers[0] is None:
                    return "OK, but the answer stream does not open with a header"
            else:
                GetMessageClass(method.output_type).FromString(replies[0])
        except Exception as ex:  # noqa: BLE001
            return f"OK, but the answer does not decode: {ex!r}"
        return None
    if (
        code == grpc.StatusCode.UNIMPLEMENTED
        and method.name == "PushPullShared"
        and details.startswith("pserver ")
    ):
        return None  # the regions cannot be mapped: the pserver's own refusal, not a missing method
    if code in BAD_CODES:
        return BAD_CODES[code]
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and not details.startswith("pserver "):
        return f"no answer within {CALL_TIMEOUT}s (a hang)"
    if not details.strip():
        return f"{code.name} without details"
    return None


def state_change(e: Env) -> Optional[str]:
    """What changed in the pserver since fuzzing began, or None."""
    engine = e.server.engine
    found = []
    if engine.step != 0:
        found.append(f"version {engine.step}")
    # Joining (Hello) and signs of life (last_seen) are no change; anything else counted is.
    roster = getattr(engine, "roster", engine)
    for owner, attrs in (
        (engine.pending, ("trainers", "touched", "sparse_sums", "positions")),
        (roster, ("closed", "dropped", "last_step", "positions")),
    ):
        for attr in attrs:
            value = getattr(owner, attr, None)
            if value:
                found.append(f"{attr} = {sorted(value) if not isinstance(value, dict) else value}")
    if engine.restored_from != -1 or engine.rollbacks.made:
        found.append("rolled back to a checkpoint")
    if engine.tables.rows:
        found.append(f"{engine.tables.rows} table rows stored")
    for name, block in engine.store.blocks.items():
        if as_bytes(block).tobytes() != e.before[name]:
            found.append(f"block {name} changed")
    return "; ".join(found) or None


def show(messages: List[bytes], nbytes: int = 40, limit: int = 2) -> str:
    if not messages:
        return "(no messages)"
    parts = [
        f"msg{i} [{len(m)} B] {m[:nbytes].hex()}{'...' if len(m) > nbytes else ''}"
        for i, m in enumerate(messages[:limit])
    ]
    if len(messages) > limit:
        parts.append(f"+{len(messages) - limit} more messages")
    return " | ".join(parts)


def tracebacks(caplog) -> List[str]:
    """Log records of unhandled exceptions: gRPC's 'Exception calling application', pserver errors."""
    out = []
    for r in caplog.records:
        if (r.name.startswith("grpc") and r.levelno >= logging.ERROR) or (
            r.name.startswith("pserver") and r.levelno >= logging.ERROR and r.exc_info
        ):
            out.append(
                f"log {r.name} {r.levelname}: {r.getMessage()[:300]}"
                + (f" ({r.exc_info[0].__name__}: {r.exc_info[1]})" if r.exc_info else "")
            )
    return out
