"""A unary call not awaited in place: a future of its reply, or of the :class:`PserverError` it failed with.

For calls a thread sends and reads later (Stats an observer polls, all pservers at
once): the gRPC call runs on no pool thread, and its failure reaches the reader
as the same domain error a blocking call raises. gRPC starts a thread to poll a
channel that had no such call in flight, each time: not for calls sent every
interval on many channels (heartbeats go through :meth:`Channels.submit`).
"""

from __future__ import annotations

from concurrent import futures

import grpc

from ..errors import PserverError
from .status_codes import details, error_of


def start_unary(
    method: grpc.UnaryUnaryMultiCallable, request, endpoint: str, what: str, timeout: float
) -> futures.Future:
    """Send ``request`` by ``method`` with a deadline of ``timeout`` s; return its future at once.

    Its result: the reply, or the PserverError saying ``what`` failed (to
    pserver ``endpoint``).
    """
    outcome: futures.Future = futures.Future()

    def ended(call: grpc.Future) -> None:
        try:
            reply = call.result()
        except grpc.RpcError as e:
            error = error_of(endpoint, f"{what} failed: {details(e)}", e)
        except Exception as e:  # noqa: BLE001 - a channel closed under the call: the reader sees why
            error = PserverError(endpoint, f"{what} failed: {e!r}")
        else:
            error = None
        if error is None:
            outcome.set_result(reply)
        else:
            outcome.set_exception(error)

    method.future(request, timeout=timeout).add_done_callback(ended)
    return outcome
