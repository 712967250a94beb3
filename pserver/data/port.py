"""A pserver's data port: the listener, its reactors and the calls they serve, started and stopped as one.

The listener is bound first (:func:`bind`), on the host of the pserver's gRPC endpoint and any free
port, so the servicer knows the port it names in every HelloReply (``data_port``): nothing needs
configuring. ``data_reactors`` threads serve every connection; the listener's hello pool is bounded
too (:mod:`.listener`).
"""

from __future__ import annotations

import logging
import ssl
from typing import Callable, List, Optional

from transpiler import PserverProgram

from ..rpc.arrival import CallsInProgress
from ..rpc.prologue import CallerChecks
from ..rpc.service.data_calls import DataCalls
from .calls import ChannelCalls
from .listener import DataListener
from .parts import Payloads
from .reactor import Reactor

log = logging.getLogger(__name__)

# The largest request payload a connection takes (a buffer grows to it only as bytes arrive).
MAX_PAYLOAD = 1 << 30


def bind(program: PserverProgram, tls: Optional[ssl.SSLContext]) -> DataListener:
    """The data port's listener, bound on the host of ``program``'s endpoint (OSError naming it if it
    cannot); ``tls``: the gRPC port's certificates as a context (:mod:`psproto.dataplane.access`)."""
    host = program.endpoint.rpartition(":")[0].strip("[]")
    try:
        return DataListener(host, 0, MAX_PAYLOAD, tls)
    except OSError as e:
        raise OSError(e.errno, f"cannot bind the data port on {host}: {e.strerror}") from None


class DataPort:
    """The data channel's server side of one pserver (see the module doc); :meth:`start`, :meth:`stop`."""

    def __init__(
        self,
        program: PserverProgram,
        listener: DataListener,
        token: Optional[str],
        data: DataCalls,
        checks: CallerChecks,
        in_progress: CallsInProgress,
        incarnation: Callable[[], int],
    ):
        cfg = program.config
        self.listener = listener
        self.reactor_count = cfg.data_reactors
        self.send_timeout = cfg.rpc_timeout
        payloads = Payloads(data.contents, allow_nonfinite=cfg.nonfinite_grads == "apply")
        self.calls = ChannelCalls(data, checks, payloads, token, in_progress, incarnation)
        self._reactors: List[Reactor] = []

    def start(self) -> None:
        """Serve: the reactors start, the listener accepts."""
        self._reactors = [
            Reactor(f"data-reactor-{i}", self.calls.serve, self.send_timeout)
            for i in range(self.reactor_count)
        ]
        self.listener.serve(self.calls.check_hello, self._reactors)
        log.info("data port %d, %d reactors", self.listener.port, self.reactor_count)

    def stop(self) -> None:
        """Stop accepting, then close every connection (parked calls end with the engine's waits)."""
        self.listener.close()
        for reactor in self._reactors:
            reactor.stop()
        self._reactors = []
