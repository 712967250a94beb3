"""The gRPC servicer: one servicer per concern of the service, composed and registered with gRPC as one.

It knows the blocks and tables only through two parts the server hands it:
what a push, pull or prefetch may carry and how a push splits
(:class:`~pserver.engine.contents.Contents`), and what to count, apply and
read (:class:`~pserver.engine.Engine`), never reaching below them. With hot
standby it holds the process's :class:`~pserver.replication.replica.Replica`
too, and the :class:`~pserver.rpc.sessions.Incarnation` trainers tell this pserver's state by.

Composed, as gRPC's Python examples compose a server of one servicer per
service: the methods of the one ParameterServer service fall into three
concerns that share nothing but what every call goes through (the caller's
checks, the counters, the sessions), so each has a servicer of its own
(:mod:`.data_calls`: pushes, pulls, prefetches; :mod:`.control_calls`: a
trainer's session, its orders, its rounds with the others, Stats;
:mod:`.standby_calls`: hot standby's replication and Lead), and
:class:`PserverServicer` builds them over the parts they share and registers
their handlers together under the service's one name.

Every method receives the raw request bytes and parses them itself, so
malformed bytes get INVALID_ARGUMENT with a message instead of a generic
deserialisation failure. Every refusal is a gRPC status naming this pserver
and what was wrong; a refused request changes nothing. Everything below the
RPC layer refuses with :mod:`pserver.errors` exceptions;
:data:`~..prologue.STATUS` is the one place they become gRPC status codes
(:mod:`..prologue`, with what every call goes through). Any other exception
is a bug: answered INTERNAL, its traceback logged.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, Optional, Sequence

import grpc

from psproto.wire import SERVICE

from ...engine import Contents, Engine
from ...engine.services.claims import StepClaims
from ...engine.services.reductions import Reductions
from ...layout.phases import LayoutStatus
from ..counters import Counters
from ..prologue import CallerChecks
from ..sessions import Incarnation, Sessions
from ..stretches import Stretches
from .control_calls import ControlCalls
from .data_calls import DataCalls
from .standby_calls import StandbyCalls


class PserverServicer:
    """The ParameterServer service: :attr:`data`, :attr:`control` and :attr:`standby` calls over one engine.

    ``replica``: the process's place in its replicated shard (None without replicas); ``incarnation``
    (default: a new one) what trainers tell this pserver's state by; ``stretches`` where parked calls'
    stretches run (:mod:`..stretches`); ``claims`` the Claim service (backup trainers; None: this pserver
    does not decide); ``data_port`` the data channel's port its Hello names (0: none); ``layout_epoch`` and
    ``pservers`` (``replicas``) the layout it serves, ``layout_status`` the job's change of layout in
    progress. The counters, the sessions and the caller's checks are shared by the three.
    """

    def __init__(
        self,
        engine: Engine,
        contents: Contents,
        reductions: Reductions,
        layout_digest: str,
        chunk_bytes: int,
        alive_window: float,
        allow_nonfinite: bool = False,
        replica=None,
        incarnation: Optional[Incarnation] = None,
        stretches: Optional[Stretches] = None,
        claims: Optional[StepClaims] = None,
        data_port: int = 0,
        layout_epoch: int = 0,
        pservers: Sequence[str] = (),
        layout_status: Optional[Callable[[], object]] = None,
        replicas: Sequence[str] = (),
    ):
        self.engine = engine
        self.contents = contents
        self.replica = replica
        self.endpoint = engine.endpoint
        self.layout_digest = layout_digest
        self.started = time.monotonic()
        self.counters = Counters()
        self.sessions = Sessions(engine.endpoint, alive_window)
        self.stretches = stretches if stretches is not None else Stretches(allowed=False)
        self.checks = CallerChecks(
            engine.endpoint,
            engine.trainers,
            self.sessions,
            replica,
            layout_digest,
            layout_epoch,
            pservers,
            layout_status or LayoutStatus,
            replicas,
        )
        checks = self.checks
        self.data = DataCalls(engine, contents, checks, self.counters, chunk_bytes, allow_nonfinite, claims)
        self.control = ControlCalls(
            engine,
            checks,
            self.counters,
            self.sessions,
            incarnation if incarnation is not None else Incarnation(),
            reductions,
            claims,
            replica,
            self.stretches,
            self.started,
            data_port,
        )
        self.standby = StandbyCalls(replica, engine, contents, self.counters, layout_epoch)

    @property
    def incarnation(self) -> int:
        """What trainers tell this pserver's state by (Hello and Heartbeat answer it)."""
        return self.control.incarnation

    def handlers(self) -> Dict[str, grpc.RpcMethodHandler]:
        """The service's handlers by method name: raw-bytes requests (parsed here), encoded replies.

        The parking methods' behaviours carry ``parking`` (:mod:`..parking`):
        :class:`~..aio.Parking` gives them asyncio handlers.
        """
        return {**self.control.handlers(), **self.data.handlers(), **self.standby.handlers()}

    def add_to_server(self, server, adapt: Callable[[Dict[str, grpc.RpcMethodHandler]], Dict] = dict) -> None:
        """Register :meth:`handlers` on ``server`` through ``adapt`` (asyncio: ``Parking.adapt``)."""
        # Registered, not generic: gRPC queues each method's arrived calls apart and the asyncio server
        # takes them up in parallel, so a heartbeat is taken up behind heartbeats, not a thousand pushes.
        server.add_registered_method_handlers(SERVICE, adapt(self.handlers()))
