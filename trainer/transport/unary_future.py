"""A unary call not awaited in place: a future of its reply, or of the :class:`PserverError` it failed with.

For calls a thread sends and reads later (Stats an observer polls, heartbeats to
several pservers at once): the gRPC call runs without a thread of its own, and
its failure reaches the reader as the same domain error a blocking call raises.
"""
from __future__ import annotations

from concurrent import futures
from typing import Optional

import grpc

from ..errors import PserverError
from .contact import Contact
from .status_codes import details, error_of


def start_unary(method: grpc.UnaryUnaryMultiCallable, request, endpoint: str, what: str, timeout: float,
                contact: Optional[Contact] = None) -> futures.Future:
    """Send ``request`` by ``method`` with a deadline of ``timeout`` s; return its future at once.

    Its result: the reply, or the PserverError saying ``what`` failed (to
    pserver ``endpoint``). ``contact`` (if given) counts the call in flight
    until it ends, and answered if it was.
    """
    outcome: futures.Future = futures.Future()
    if contact is not None:
        contact.begin()

    def ended(call: grpc.Future) -> None:
        try:
            reply = call.result()
        except grpc.RpcError as e:
            error = error_of(endpoint, f"{what} failed: {details(e)}", e)
        except Exception as e:  # noqa: BLE001 - a channel closed under the call: the reader sees why
            error = PserverError(endpoint, f"{what} failed: {e!r}")
        else:
            error = None
        if contact is not None:
            contact.end(answered=error is None)
        if error is None:
            outcome.set_result(reply)
        else:
            outcome.set_exception(error)
    try:
        method.future(request, timeout=timeout).add_done_callback(ended)
    except BaseException:
        if contact is not None:
            contact.end(answered=False)
        raise
    return outcome
