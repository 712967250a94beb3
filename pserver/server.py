"""ParameterServer: one pserver process's gRPC server and its lifecycle.

It builds every part first and hands each to the parts that use it: the
blocks and table shards; the listeners of the engine's changes (replication,
scheduled checkpoints and exports, with the :class:`~pserver.engine.FileWrites`
switch a hot standby's backup keeps off); the engine; what requests may carry
(:class:`~pserver.engine.Contents`); with replicas, the
:class:`~pserver.replication.replica.Replica`; and the servicer over them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import secrets
import signal
import sys
import threading
from concurrent import futures
from typing import Optional

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from psproto.options import server_options
from psproto.security import Security, TokenCheck
from psproto.wire import SERVICE as SERVICE_NAME
from transpiler import PserverProgram, StartupProgram

from .checkpoint import Checkpointer
from .engine import (
    AsyncEngine,
    Contents,
    FileWrites,
    Reductions,
    Replication,
    ScheduledCheckpoints,
    ScheduledExports,
    StepClaims,
    SyncEngine,
)
from .errors import LostLead
from .ops.health import HealthPort
from .ops.metrics import MetricsServer, PserverCollector
from .ops.ports import SidePorts, split_host
from .rpc import PserverServicer
from .rpc.aio import Parking
from .rpc.arrival import ArrivalInterceptor, CallsInProgress
from .rpc.sessions import Incarnation
from .rpc.stretches import Stretches, stretch_place
from .store import BlockStore
from .tables import TableSet
from .tables.serving.exporter import TableExporter

log = logging.getLogger(__name__)

SWITCH_INTERVAL_S = 0.0005  # how soon a thread waiting for the GIL gets it (see serve)


class ParameterServer:
    """A pserver: owns the blocks and table shards of its :class:`PserverProgram`, serves trainers.

    ``serve()`` blocks until every trainer has closed (then returns), or until
    SIGTERM / Ctrl-C (then shuts down gracefully). ``start()`` / ``stop()``
    run it in the background, for tests and embedding. ``tables_from`` names
    a directory of saved tables (``Trainer.save_tables``, any number of
    pservers) to start the distributed tables from. ``security`` (default:
    ``Security.from_env()``, the ``PS_AUTH_TOKEN*`` / ``PS_TLS_*`` variables)
    turns on the auth token check and TLS.

    Side ports (see :mod:`pserver.ops.ports`): with ``metrics_port`` (or
    ``PS_METRICS_PORT``) it serves Prometheus metrics at ``/metrics``
    (:mod:`pserver.ops.metrics`); with ``health_port`` (or ``PS_HEALTH_PORT``) a
    health-only gRPC server without the token, for Kubernetes' probes
    (:mod:`pserver.ops.health`). Both bind on the endpoint's host; after
    :meth:`start`, :attr:`metrics_port` and :attr:`health_port` hold the ports
    bound (None: off).
    """

    def __init__(
        self,
        program: PserverProgram,
        startup: Optional[StartupProgram] = None,
        tables_from: Optional[str] = None,
        security: Optional[Security] = None,
    ):
        if not isinstance(program, PserverProgram):
            raise TypeError(f"program must be a PserverProgram, got {type(program).__name__}")
        # Resolved first: a bad token or certificate setting fails before any state is built.
        self.security = security if security is not None else Security.from_env()
        self.security.check_server()
        self.program = program
        self.endpoint = program.endpoint
        cfg = program.config
        self.side_ports = SidePorts.resolve(cfg.metrics_port, cfg.health_port, self.endpoint)
        self.metrics_port: Optional[int] = None
        self.health_port: Optional[int] = None
        store = BlockStore(program, startup)
        tables = TableSet(program, tables_from)
        checkpointer = (
            None
            if cfg.checkpoint_dir is None
            else Checkpointer(
                cfg.checkpoint_dir,
                store,
                tables,
                program.shard,
                len(program.pservers),
                program.endpoint,
                program.sync_mode,
                every=cfg.checkpoint_every,
                keep=cfg.checkpoint_keep,
            )
        )
        # Until it leads, a replica writes no checkpoint and no export: its primary does.
        self.files = FileWrites(on=not program.replicated)
        self.exporter: Optional[TableExporter] = None
        if cfg.export_dir is not None and (cfg.export_every or cfg.export_every_seconds) and tables:
            self.exporter = TableExporter(
                tables,
                cfg.export_dir,
                cfg.export_every,
                cfg.export_base_every,
                cfg.export_keep_bases,
                cfg.export_every_seconds,
                program.sync_mode,
            )
        # The backup first learns of each change, then the files are written.
        replication = Replication() if program.replicated else None
        listeners = [replication] if replication is not None else []
        if checkpointer is not None:
            listeners.append(ScheduledCheckpoints(checkpointer, self.files, program.endpoint))
        if self.exporter is not None:
            listeners.append(ScheduledExports(self.exporter, self.files))
        # The Reduce service waits for the trainers the engine still expects and is woken when that
        # set changes: each needs the other, so the service, built first, asks self.engine (set just
        # below) only when a trainer calls. A trainer whose Reduce waits is alive to the engine, and
        # heard from when its round ends.
        self.reductions = Reductions(
            self.endpoint,
            cfg.barrier_timeout,
            expected=lambda: self.engine.live(),
            admit=lambda trainer_id: self.engine.check_live(trainer_id),
            released=lambda trainer_id: self.engine.touch(trainer_id),
        )
        # A trainer with a call still being served (a push's answer made and sent after its step applied,
        # a heartbeat waiting for a pool thread) is alive to the engine too, and heard from when it ends.
        self._serving = CallsInProgress(self._arrived, program.trainers, holds=self._holds)
        args = (store, tables, program.trainers, program.endpoint, cfg.barrier_timeout, checkpointer)
        # Backup trainers: the first pserver decides each sync step's trainers (claims wait like Reduce
        # rounds).
        self.claims: Optional[StepClaims] = None
        parts = dict(
            listeners=listeners,
            on_wait=self._observe_barrier_wait,
            on_roster_change=self._roster_changed,
            held_elsewhere=lambda: (
                self.reductions.parked_trainers()
                | self._serving.trainers()
                | (self.claims.parked_trainers() if self.claims is not None else set())
            ),
        )
        if program.sync_mode:
            self.engine = SyncEngine(*args, **parts)
        else:
            self.engine = AsyncEngine(*args, max_staleness=cfg.max_staleness, **parts)
        if cfg.backup_trainers and program.sync_mode and program.shard == 0:
            self.claims = StepClaims(
                self.endpoint,
                program.trainers,
                cfg.backup_trainers,
                cfg.barrier_timeout,
                live=self.engine.live,
                applied=lambda: self.engine.step,
                admit=self.engine.check_live,
                rollbacks=self.engine.rollbacks,
                released=self.engine.touch,
            )
        if checkpointer is not None:
            if self.engine.resume():
                log.info(
                    "pserver %s resumes from the checkpoint at step %d under %s%s",
                    self.endpoint,
                    self.engine.step,
                    cfg.checkpoint_dir,
                    " (tables_from is ignored)" if tables_from else "",
                )
        self._server: Optional[grpc.aio.Server] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._loop_thread: Optional[threading.Thread] = None
        self._pool: Optional[futures.ThreadPoolExecutor] = None
        self._health = None  # grpc_health's asyncio HealthServicer, once serving
        self._health_port: Optional[HealthPort] = None
        self._metrics: Optional[MetricsServer] = None
        self._finished = threading.Event()
        self._stopped = False
        self._interceptors = self.security.server_interceptors(aio=True)
        # Trainers tell a restarted shard by the incarnation Hello answers: with replicas it names the
        # state's lineage, the same on both processes, so a failover is no restart to them.
        incarnation = Incarnation()
        self.fenced = False
        self.replica = None
        if program.replicated:
            self.replica = self._replica(program, replication, incarnation)
        # Where parked calls' CPU stretches run: on the event loop where nothing in them blocks.
        on_loop, why = stretch_place(program)
        self.stretches = Stretches(on_loop)
        log.info(
            "pserver %s: parked calls' stretches run %s (%s)",
            self.endpoint,
            "on the event loop" if on_loop else "in the handler pool",
            why,
        )
        self.servicer = PserverServicer(
            self.engine,
            Contents(store, tables),
            self.reductions,
            program.layout_digest,
            cfg.chunk_bytes,
            alive_window=cfg.session_alive_window,
            allow_nonfinite=cfg.nonfinite_grads == "apply",
            replica=self.replica,
            incarnation=incarnation,
            stretches=self.stretches,
            claims=self.claims,
        )

    def _roster_changed(self) -> None:
        """The engine's live trainers may have changed (or it rolled back): the waiting rounds and claims
        look again."""
        self.reductions.roster_changed()
        if self.claims is not None:
            self.claims.roster_changed()

    def _replica(self, program: PserverProgram, replication: Replication, incarnation: Incarnation):
        """Hot standby: this process is one of its shard's two; etcd decides whether it leads or follows."""
        from .replication.etcd import EtcdCoordinator
        from .replication.replica import Replica
        from .rpc.replica_link import ReplicaLink

        cfg = program.config
        prefix = (cfg.coordinator_prefix or f"/torch-pserver/{program.layout_digest}").rstrip("/")
        coordinator = EtcdCoordinator(
            cfg.coordinator, prefix, program.shard, secrets.token_hex(8), ttl=cfg.replica_lease_ttl
        )
        self._link = ReplicaLink(self.security, cfg.chunk_bytes)
        return Replica(
            self.engine,
            program,
            coordinator,
            self._link,
            replication,
            self.files,
            on_lineage=incarnation.adopt,
            on_fenced=self._on_fenced,
        )

    def _on_fenced(self) -> None:
        self.fenced = True
        self._finished.set()

    def start(self) -> "ParameterServer":
        """Bind the endpoint (and the side ports) and start serving in background threads.

        OSError naming the address when a port cannot be bound; whatever was
        started by then is stopped again.
        """
        try:
            self._start_side_ports()
            self._start_main()
        except BaseException:
            self._stop_side_ports()
            self._stop_main(0)
            raise
        if self._health_port is not None:
            self._health_port.serving()
        if self.replica is not None:
            self.replica.start()
        threading.Thread(target=self._watch_trainers, daemon=True, name="pserver-watch").start()
        threading.Thread(target=self._watch_heartbeats, daemon=True, name="pserver-heartbeats").start()
        return self

    def _start_side_ports(self) -> None:
        """The health port (answering NOT_SERVING until the main port serves) and the metrics server."""
        host = split_host(self.endpoint)
        if self.side_ports.health is not None:
            self._health_port = HealthPort(host, self.side_ports.health, ("", SERVICE_NAME))
            self.health_port = self._health_port.start()
            log.info(
                "pserver %s: health port %d on %s (grpc.health.v1 only, plaintext, no auth token)",
                self.endpoint,
                self.health_port,
                host,
            )
        if self.side_ports.metrics is not None:
            auth = next((i for i in self._interceptors if isinstance(i, TokenCheck)), None)
            collector = PserverCollector(self.servicer, self.program.shard, len(self.program.pservers), auth)
            self._metrics = MetricsServer(collector, self.endpoint)
            self.metrics_port = self._metrics.start(host, self.side_ports.metrics)
            log.info(
                "pserver %s: Prometheus metrics at http://%s:%d/metrics",
                self.endpoint,
                f"[{host}]" if ":" in host else host,
                self.metrics_port,
            )

    def _stop_side_ports(self) -> None:
        if self._health_port is not None:
            self._health_port.stop()
        metrics, self._metrics = self._metrics, None  # no more barrier waits observed
        if metrics is not None:
            metrics.stop()

    def _observe_barrier_wait(self, seconds: float) -> None:
        """The engine's ``on_wait``: a sync step's wait, into the barrier histogram while metrics are served.

        The histogram lives with the metrics server, which starts and stops
        with the side ports; without it the wait is not recorded.
        """
        metrics = self._metrics  # read once: stopping the side ports unsets it
        if metrics is not None:
            metrics.barrier_wait.observe(seconds)

    def _start_main(self) -> None:
        """The training service (with health and reflection) on the endpoint, behind the token.

        gRPC's asyncio server on an event-loop thread of this server's own: a
        call that waits (a sync step's barrier, ``min_step``, staleness, a
        Reduce round) parks on the loop and holds no thread (:mod:`.rpc.aio`);
        the CPU work of every call runs in a pool of ``pserver_rpc_workers``
        threads (0: ``max(4, cores)``), whatever the number of trainers.
        """
        cfg = self.program.config
        workers = cfg.pserver_rpc_workers or max(4, os.cpu_count() or 1)
        self._pool = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pserver")
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="pserver-loop")
        self._loop_thread.start()
        self._server = self._on_loop(self._serve_main(cfg))
        log.info("pserver %s: %s", self.endpoint, self.security.describe(server=True))
        if self.security.token and not self.security.tls:
            log.warning(
                "pserver %s: the auth token travels in plaintext; set PS_TLS_CERT and "
                "PS_TLS_KEY to encrypt it",
                self.endpoint,
            )
        log.info(
            "pserver %s serving %d blocks (%s bytes) and shard %d/%d of %d tables, %s mode, "
            "%d trainers (%d handler threads)",
            self.endpoint,
            len(self.program.blocks),
            f"{self.engine.store.nbytes:,}",
            self.program.shard,
            len(self.program.pservers),
            len(self.program.tables),
            "sync" if self.program.sync_mode else "async",
            self.program.trainers,
            workers,
        )

    def _on_loop(self, coroutine, timeout: Optional[float] = None):
        """Run ``coroutine`` on the server's event loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    async def _serve_main(self, cfg) -> grpc.aio.Server:
        """On the loop: build, bind and start the asyncio server; OSError naming the address if it cannot
        bind."""
        server = grpc.aio.server(
            migration_thread_pool=self._pool,
            options=server_options(
                cfg.chunk_bytes,
                fast_keepalive=self.program.replicated,
                queue_s=math.ceil(cfg.barrier_timeout + cfg.rpc_timeout),
                trainers=self.program.trainers,
            ),
            interceptors=[*self._interceptors, ArrivalInterceptor(self._arrived, self.program.trainers)],
        )
        self.stretches.bind(asyncio.get_running_loop())
        self.servicer.add_to_server(server, Parking(self._pool, self.stretches, self._serving).adapt)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        try:
            port = self.security.add_port(server, self.endpoint)
        except RuntimeError as e:
            port, detail = 0, str(e)
        else:
            detail = "bind returned port 0"
        if port == 0:
            await server.stop(None)
            raise OSError(
                f"pserver cannot bind {self.endpoint} ({detail}); is the port in use "
                f"or the address not on this host?"
            )
        await server.start()
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        return server

    def _stop_main(self, grace: Optional[float]) -> None:
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
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _holds(self, trainer_id: int, incarnation: int) -> bool:
        """Whether ``trainer_id``'s process ``incarnation`` holds the id's session (not a newcomer, nor a
        fenced one)."""
        return self.servicer.sessions.incarnation(trainer_id) == incarnation

    def _arrived(self, trainer_id: int, incarnation: int) -> None:
        """A call of ``trainer_id``'s process ``incarnation`` arrived: a sign of life if it holds the id's
        session."""
        if self._holds(trainer_id, incarnation):
            self.engine.touch(trainer_id)

    def _watch_heartbeats(self) -> None:
        cfg = self.program.config
        while not self._finished.wait(cfg.heartbeat_interval / 2):
            self.engine.drop_silent(cfg.heartbeat_timeout, cfg.trainer_rejoin_timeout)

    def checkpoint(self) -> Optional[str]:
        """Write a checkpoint now if ``checkpoint_dir`` is set; its path, or None (failure logged).

        A replica that does not lead writes none: its primary does, and a
        fenced one may hold updates nobody acknowledged.
        """
        if self.engine.checkpointer is None or not self.files.on or self.fenced:
            return None
        try:
            return self.engine.checkpoint()[1]
        except Exception:  # a failed last checkpoint must not stop the shutdown
            log.exception("pserver %s: checkpoint at shutdown failed", self.endpoint)
            return None

    def _watch_trainers(self) -> None:
        self.engine.all_closed.wait()
        if not self._finished.is_set():
            log.info("pserver %s: all %d trainers closed", self.endpoint, self.program.trainers)
            self._finished.set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until every trainer has closed or stop() was called; False on timeout."""
        return self._finished.wait(timeout)

    def stop(self, grace: float = 5.0) -> None:
        """Stop serving: health goes NOT_SERVING, waiters wake, in-flight calls get ``grace`` s.

        The health port answers NOT_SERVING until the main port has stopped,
        then closes; the metrics server stops last.
        """
        if self._stopped:
            return
        self._stopped = True
        self._finished.set()
        if self.replica is not None:
            self.replica.stop()  # a primary steps down first: its backup leads without waiting for the lease
        if self._health is not None and self._loop is not None:
            self._on_loop(self._health.enter_graceful_shutdown())
        if self._health_port is not None:
            self._health_port.shutting_down()
        self.engine.stop()
        if self.exporter is not None:
            self.exporter.close()
        self.reductions.stop()
        if self.claims is not None:
            self.claims.stop()
        self._stop_main(grace)
        self.engine.tables.close()
        if self.replica is not None:
            self._link.close()
        self._stop_side_ports()
        log.info("pserver %s stopped after %d updates", self.endpoint, self.engine.step)

    def serve(self) -> None:
        """Start, block until all trainers closed or SIGTERM/SIGINT, then stop cleanly.

        Hot standby: a process that lost the lead of its shard (fenced) stops
        and raises :class:`~pserver.errors.LostLead`, so that its supervisor
        restarts it; it then rejoins as the backup.
        """
        torch.set_num_threads(self.program.config.pserver_torch_threads)
        # The event loop sends every answer: it must get the GIL back from the pool's threads soon
        # (Python's default hands it over after 5 ms, longer than a job S push's CPU).
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self.start()
        previous = {}
        if threading.current_thread() is threading.main_thread():

            def on_signal(signum, frame):
                log.info("pserver %s: %s received, shutting down", self.endpoint, signal.Signals(signum).name)
                self._finished.set()

            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, on_signal)
        try:
            self._finished.wait()
            # SIGTERM, Ctrl-C or the end of training: probes see the shutdown at once, while the
            # last checkpoint is written; then keep the model.
            if self._health_port is not None:
                self._health_port.shutting_down()
            self.checkpoint()
        finally:
            self.stop(grace=1.0 if self.fenced else 5.0)  # a fenced process answers nothing worth waiting for
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if self.fenced:
            raise LostLead(
                f"pserver {self.endpoint} lost the lead of shard {self.program.shard} and stopped; "
                f"start it again to rejoin as the backup"
            )

    def __enter__(self) -> "ParameterServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop(grace=1.0)
