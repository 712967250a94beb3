"""The pserver's main port: the ParameterServer service on its endpoint, served by gRPC's asyncio server.

The server runs on an event-loop thread of this port's own: a call that waits (a sync step's barrier,
``min_step``, staleness, a Reduce round) parks on the loop and holds no thread (:mod:`.aio`); the CPU
work of every call runs in a pool of ``pserver_rpc_workers`` threads (0: ``max(4, cores)``), whatever
the number of trainers. Behind the token check (and TLS) it serves the service, health and reflection.

Stopping goes in order: the server (in-flight calls get their grace), then the loop, then the server is
let go, then the loop closes (see :meth:`MainPort.stop`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
from concurrent import futures
from typing import Callable, Optional, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from psproto.options import server_options
from psproto.security import Security
from psproto.wire import SERVICE
from transpiler import PserverProgram

from .aio import Parking
from .arrival import ArrivalInterceptor, CallsInProgress
from .service import PserverServicer
from .stretches import Stretches

log = logging.getLogger(__name__)


class MainPort:
    """The service on ``program``'s endpoint: :meth:`start` binds and serves, :meth:`stop` stops in order.

    ``interceptors`` come first on every call (the token check); then each trainer call's arrival goes
    to ``arrived(trainer id, incarnation)`` (:class:`~.arrival.ArrivalInterceptor`), and ``calls`` counts
    it while it is served (:class:`~.aio.Parking`). ``stretches`` learns the loop once it runs.
    """

    def __init__(
        self,
        program: PserverProgram,
        security: Security,
        interceptors: Sequence,
        servicer: PserverServicer,
        stretches: Stretches,
        calls: CallsInProgress,
        arrived: Callable[[int, int], object],
    ):
        self.program = program
        self.security = security
        self.interceptors = tuple(interceptors)
        self.servicer = servicer
        self.stretches = stretches
        self.calls = calls
        self.arrived = arrived
        cfg = program.config
        self.workers = cfg.pserver_rpc_workers or max(4, os.cpu_count() or 1)
        self.pool: Optional[futures.ThreadPoolExecutor] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._loop_thread: Optional[threading.Thread] = None
        self._server: Optional[grpc.aio.Server] = None
        self._health = None  # grpc_health's asyncio HealthServicer, once serving

    def start(self) -> None:
        """Start the loop's thread and the pool, then bind and serve (logged); OSError naming the address if
        it cannot bind (then :meth:`stop` undoes what started)."""
        self.pool = futures.ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="pserver")
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="pserver-loop")
        self._loop_thread.start()
        self._server = self._on_loop(self._serve())
        program, endpoint = self.program, self.program.endpoint
        log.info("pserver %s: %s", endpoint, self.security.describe(server=True))
        if self.security.token and not self.security.tls:
            log.warning(
                "pserver %s: the auth token travels in plaintext; set PS_TLS_CERT and "
                "PS_TLS_KEY to encrypt it",
                endpoint,
            )
        log.info(
            "pserver %s serving %d blocks (%s bytes) and shard %d/%d of %d tables, %s mode, "
            "%d trainers (%d handler threads)",
            endpoint,
            len(program.blocks),
            f"{self.servicer.engine.store.nbytes:,}",
            program.shard,
            len(program.pservers),
            len(program.tables),
            "sync" if program.sync_mode else "async",
            program.trainers,
            self.workers,
        )

    def _on_loop(self, coroutine, timeout: Optional[float] = None):
        """Run ``coroutine`` on the port's event loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    async def _serve(self) -> grpc.aio.Server:
        """On the loop: build, bind and start the asyncio server; OSError naming the address if it cannot
        bind."""
        cfg = self.program.config
        server = grpc.aio.server(
            migration_thread_pool=self.pool,
            options=server_options(
                cfg.chunk_bytes,
                fast_keepalive=self.program.replicated,
                queue_s=math.ceil(cfg.barrier_timeout + cfg.rpc_timeout),
                trainers=self.program.trainers,
            ),
            interceptors=[*self.interceptors, ArrivalInterceptor(self.arrived, self.program.trainers)],
        )
        self.stretches.bind(asyncio.get_running_loop())
        self.servicer.add_to_server(server, Parking(self.pool, self.stretches, self.calls).adapt)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        endpoint = self.program.endpoint
        try:
            port = self.security.add_port(server, endpoint)
        except RuntimeError as e:
            port, detail = 0, str(e)
        else:
            detail = "bind returned port 0"
        if port == 0:
            await server.stop(None)
            raise OSError(
                f"pserver cannot bind {endpoint} ({detail}); is the port in use "
                f"or the address not on this host?"
            )
        await server.start()
        for service in ("", SERVICE):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        return server

    def shutting_down(self) -> None:
        """Health answers NOT_SERVING from now on; calls are still served until :meth:`stop`."""
        if self._health is not None and self._loop is not None:
            self._on_loop(self._health.enter_graceful_shutdown())

    def stop(self, grace: Optional[float]) -> None:
        """Stop the asyncio server (in-flight calls get ``grace`` s), then its loop, then its pool.

        gRPC's asyncio layer has one poller per process, shut down when its last asyncio server is
        freed: it unhooks its socket from the loops and closes it. Freed here while the loop's thread
        still ran, it closed the socket under the loop reading it (``Exception in callback None()`` ...
        ``OSError: [Errno 9] Bad file descriptor`` at about one SIGTERM in three). So the server is let
        go only once the loop has stopped and its thread ended, and the loop closes after that.
        """
        server, self._server = self._server, None
        if server is not None:
            self._on_loop(server.stop(grace))
        loop, self._loop = self._loop, None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
            self._loop_thread.join()
        del server  # the last reference: the poller shuts down now, with no loop running
        if loop is not None:
            loop.close()
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
