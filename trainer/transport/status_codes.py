"""The one mapping of the wire's status codes to what they mean for a trainer (trainer/errors.py).

Only the transport reads gRPC status codes; everything above it (recovery,
node groups, the steppers) decides on the kinds of :mod:`trainer.errors`.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import grpc

from ..errors import DOWN, FENCED, MOVED, REFUSED, RESYNC, TIMEOUT, FencedError, PserverError

# The one mapping of the wire's status codes to what they mean for a trainer (trainer/errors.py).
_KINDS = {
    grpc.StatusCode.UNAVAILABLE: DOWN,  # down, restarting, or not reachable yet
    grpc.StatusCode.CANCELLED: DOWN,  # a pserver shutting down cancels the calls it holds
    grpc.StatusCode.ABORTED: RESYNC,  # dropped, rolled back, resumed: call Hello again
    grpc.StatusCode.PERMISSION_DENIED: FENCED,  # a newer process of this trainer id took over
    grpc.StatusCode.DEADLINE_EXCEEDED: TIMEOUT,  # a barrier that timed out names who is missing
    grpc.StatusCode.NOT_FOUND: MOVED,  # the job changed its pserver count; the answer names its layout
}


def kind_of(code: Optional[grpc.StatusCode]) -> str:
    """The :mod:`trainer.errors` kind of a call that ended with status ``code`` (None: no status at all)."""
    return _KINDS.get(code, REFUSED)


def error_of(endpoint: str, message: str, e: grpc.RpcError) -> PserverError:
    """The :class:`PserverError` (or :class:`FencedError`) saying ``message`` for the failed call ``e``."""
    code = e.code() if hasattr(e, "code") else None
    kind, status = kind_of(code), code.name if code else ""
    return (
        FencedError(endpoint, message, status)
        if kind == FENCED
        else PserverError(endpoint, message, kind, status)
    )


def details(e: grpc.RpcError) -> str:
    """``CODE: details`` of a failed call, for messages."""
    code = e.code() if hasattr(e, "code") else None
    text = e.details() if hasattr(e, "details") else str(e)
    return f"{code.name if code else 'ERROR'}: {text}"


@contextlib.contextmanager
def call_errors(endpoint: str, what: str) -> Iterator[None]:
    """Around a call to ``endpoint`` (``what``, for messages): a failed call raised as :func:`error_of`'s
    error, an answer found malformed (``ValueError``) as a :class:`PserverError` saying so."""
    try:
        yield
    except grpc.RpcError as e:
        raise error_of(endpoint, f"{what} failed: {details(e)}", e) from None
    except ValueError as e:
        raise PserverError(endpoint, f"{what}: answer is malformed: {e}") from None
