"""ParameterServer: one pserver process's parts, built in the order they depend on, and its lifecycle.

It builds every part first and hands each to the parts that use it, at their construction: the
blocks and table shards; the listeners of the engine's changes (replication, scheduled checkpoints
and exports, with the :class:`~pserver.engine.FileWrites` switch a hot standby's backup keeps off);
the side ports' servers (:mod:`pserver.ops.side_ports`, whose barrier histogram the engine's waits
go to); the engine; the Reduce and Claim services, built from it; with replicas, the
:class:`~pserver.replication.replica.Replica`; the servicer over them; the calls in progress; and
the main port that serves the servicer (:mod:`pserver.rpc.main_port`). The engine and the parts
that hold trainers' calls outside it need each other: a notification point built before the engine
breaks that cycle (:mod:`pserver.held_elsewhere`).
"""

from __future__ import annotations

import logging
import secrets
import sys
import threading
from typing import Optional

import torch

from psproto.dataplane.access import server_context as data_tls
from psproto.security import Security, TokenCheck
from transpiler import PserverProgram, StartupProgram
from transpiler.layout.change import program_in, replicas_of

from . import stop_signals
from .checkpoint import Checkpointer
from .data.port import DataPort
from .data.port import bind as bind_data_port
from .engine import (
    Contents,
    Engine,
    FileWrites,
    Gate,
    Reductions,
    Replication,
    ScheduledCheckpoints,
    ScheduledExports,
    StepClaims,
)
from .engine.modes import for_plan
from .errors import LostLead
from .held_elsewhere import HeldElsewhere
from .layout.joining import pserver_program_now
from .layout.switch import LayoutSwitch
from .ops.metrics import PserverCollector
from .ops.ports import SidePorts
from .ops.side_ports import SidePortServers
from .rpc import PserverServicer
from .rpc.arrival import CallsInProgress
from .rpc.main_port import MainPort
from .rpc.sessions import Incarnation
from .rpc.stretches import Stretches
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
        now = pserver_program_now(program)  # a job that changed its pserver count runs a later layout
        program, startup = now, (startup if now is program else None)
        # Resolved first: a bad token or certificate setting fails before any state is built.
        self.security = security if security is not None else Security.from_env()
        self.security.check_server()
        self.program = program
        self.endpoint = program.endpoint
        cfg = program.config
        # Before the engine, which reports its sync waits to their barrier histogram; the metrics server
        # reads the servicer (built on the engine) only once started.
        self.side_ports = SidePortServers(
            SidePorts.resolve(cfg.metrics_port, cfg.health_port, self.endpoint), self.endpoint
        )
        self._finished = threading.Event()
        self._stopped = False
        self.fenced = False
        store = BlockStore(program, startup)
        tables = TableSet(program, tables_from)
        checkpointer = Checkpointer.for_program(program, store, tables)
        # Until it leads, a replica writes no checkpoint and no export: its primary does.
        self.files = FileWrites(on=not program.replicated)
        self.exporter: Optional[TableExporter] = TableExporter.for_program(program, tables)
        # The backup first learns of each change, then the files are written.
        replication = Replication() if program.replicated else None
        listeners = [replication] if replication is not None else []
        if checkpointer is not None:
            listeners.append(ScheduledCheckpoints(checkpointer, self.files, program.endpoint))
        if self.exporter is not None:
            listeners.append(ScheduledExports(self.exporter, self.files))
        # A change of the job's pserver count stops this generation after its switch step (pserver/layout/).
        self.layout = None
        if cfg.checkpoint_dir:
            self.layout = LayoutSwitch(program, self._finished)
            listeners.append(self.layout)
        # The engine asks the parts that hold trainers' calls outside it (the Reduce and Claim services, the
        # calls being served) whom they hold, and tells them when its roster changes; they ask the engine
        # whom they expect. Each needs the other: the engine gets their notification point, built first, and
        # each part joins it once built from the engine, before anything is served.
        held = HeldElsewhere()
        args = (store, tables, program.trainers, program.endpoint, cfg.barrier_timeout, checkpointer)
        parts = dict(
            listeners=listeners,
            on_wait=self.side_ports.observe_barrier_wait,
            on_roster_change=held.roster_changed,
            held_elsewhere=held.trainers,
        )
        # What a push does is the plan's mode's to decide: the engine calls its handler (engine/modes/).
        self.engine = Engine(*args, mode=for_plan(program), gate=self.layout or Gate(), **parts)
        engine = self.engine
        # A trainer whose Reduce waits is alive to the engine, and heard from when its round ends.
        self.reductions = Reductions(
            self.endpoint,
            cfg.barrier_timeout,
            expected=engine.live,
            admit=engine.check_live,
            released=engine.touch,
        )
        held.join(self.reductions.parked_trainers, self.reductions.roster_changed)
        # Backup trainers: the first pserver decides each sync step's trainers (claims wait as rounds do).
        self.claims: Optional[StepClaims] = None
        if cfg.backup_trainers and program.sync_mode and program.shard == 0:
            self.claims = StepClaims(
                self.endpoint,
                program.trainers,
                cfg.backup_trainers,
                cfg.barrier_timeout,
                live=engine.live,
                applied=lambda: engine.step,
                admit=engine.check_live,
                rollbacks=engine.rollbacks,
                released=engine.touch,
                counted=engine.holds_push_of,
                # Hot standby: each set reaches the backup before a claim of it is answered.
                **({"on_made": replication.record_step_sets} if replication is not None else {}),
            )
            held.join(self.claims.parked_trainers, self.claims.roster_changed)
        if checkpointer is not None:
            if engine.resume():
                log.info(
                    "pserver %s resumes from the checkpoint at step %d under %s%s",
                    self.endpoint,
                    engine.step,
                    cfg.checkpoint_dir,
                    " (tables_from is ignored)" if tables_from else "",
                )
        if self.layout is not None:
            self.layout.start(engine)
        # Trainers tell a restarted shard by the incarnation Hello answers: with replicas it names the
        # state's lineage, the same on both processes, so a failover is no restart to them.
        incarnation = Incarnation()
        self.replica, self._link = None, None
        if program.replicated:
            self.replica, self._link = self._replica(program, replication, incarnation)
        # Where parked calls' CPU stretches run: on the event loop where nothing in them blocks.
        self.stretches = Stretches.placed(program)
        # The data port is bound before the servicer is built: every HelloReply names it.
        self._data_listener = bind_data_port(program, data_tls(self.security))
        self.servicer = PserverServicer(
            engine,
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
            data_port=self._data_listener.port,
            layout_epoch=program.layout_epoch,
            pservers=program.pservers,
            layout_status=self.layout.status if self.layout is not None else None,
            replicas=replicas_of(program),
        )
        # A trainer with a call still being served (a push's answer made and sent after its step applied,
        # a heartbeat waiting for a pool thread) is alive to the engine too, and heard from when it ends.
        self._serving = CallsInProgress(self._arrived, program.trainers, holds=self._holds)
        held.join(self._serving.trainers)
        self._data_port = DataPort(
            program,
            self._data_listener,
            self.security.token,
            self.servicer.data,
            self.servicer.checks,
            self._serving,
            lambda: self.servicer.incarnation,
        )
        self._interceptors = self.security.server_interceptors(aio=True)
        self._main_port = MainPort(
            program,
            self.security,
            self._interceptors,
            self.servicer,
            self.stretches,
            self._serving,
            self._arrived,
        )

    @property
    def data_port(self) -> int:
        """The data port bound (docs/dataplane.md), the one every HelloReply names."""
        return self._data_listener.port

    @property
    def metrics_port(self) -> Optional[int]:
        """The metrics port bound (after :meth:`start`; None: off)."""
        return self.side_ports.metrics_port

    @property
    def health_port(self) -> Optional[int]:
        """The health port bound (after :meth:`start`; None: off)."""
        return self.side_ports.health_port

    def _replica(self, program: PserverProgram, replication: Replication, incarnation: Incarnation):
        """Hot standby: this process is one of its shard's two; etcd decides whether it leads or follows.

        (the :class:`~pserver.replication.replica.Replica`, the link to the shard's other process).
        """
        from .replication.coordination import shards_prefix
        from .replication.etcd import EtcdCoordinator
        from .replication.replica import Replica
        from .rpc.replica_link import ReplicaLink

        cfg = program.config
        coordinator = EtcdCoordinator(
            cfg.coordinator,
            shards_prefix(program),
            program.shard,
            secrets.token_hex(8),
            ttl=cfg.replica_lease_ttl,
        )
        link = ReplicaLink(self.security, cfg.chunk_bytes)
        replica = Replica(
            self.engine,
            program,
            coordinator,
            link,
            replication,
            self.files,
            on_lineage=incarnation.adopt,
            on_fenced=self._on_fenced,
            claims=self.claims,
        )
        return replica, link

    def _on_fenced(self) -> None:
        self.fenced = True
        self._finished.set()

    def _holds(self, trainer_id: int, incarnation: int) -> bool:
        """Whether ``trainer_id``'s process ``incarnation`` holds the id's session (not a newcomer, nor a
        fenced one)."""
        return self.servicer.sessions.incarnation(trainer_id) == incarnation

    def _arrived(self, trainer_id: int, incarnation: int) -> None:
        """A call of ``trainer_id``'s process ``incarnation`` arrived: a sign of life if it holds the id's
        session."""
        if self._holds(trainer_id, incarnation):
            self.engine.touch(trainer_id)

    def start(self) -> "ParameterServer":
        """Bind the endpoint (and the side ports) and start serving in background threads.

        OSError naming the address when a port cannot be bound; whatever was
        started by then is stopped again.
        """
        try:
            auth = next((i for i in self._interceptors if isinstance(i, TokenCheck)), None)
            program = self.program
            self.side_ports.start(PserverCollector(self.servicer, program.shard, len(program.pservers), auth))
            self._main_port.start()
            self._data_port.start()
        except BaseException:
            self.side_ports.stop()
            self._main_port.stop(0)
            self._data_port.stop()
            raise
        self.side_ports.serving()
        if self.replica is not None:
            self.replica.start()
        threading.Thread(target=self._watch_trainers, daemon=True, name="pserver-watch").start()
        threading.Thread(target=self._watch_heartbeats, daemon=True, name="pserver-heartbeats").start()
        return self

    def _watch_heartbeats(self) -> None:
        cfg = self.program.config
        while not self._finished.wait(cfg.heartbeat_interval / 2):
            self.engine.drop_silent(cfg.heartbeat_timeout, cfg.trainer_rejoin_timeout)

    def checkpoint(self) -> Optional[str]:
        """Write a checkpoint now if ``checkpoint_dir`` is set; its path, or None (failure logged).

        A replica that does not lead writes none: its primary does, and a
        fenced one may hold updates nobody acknowledged.
        """
        moved = self.layout is not None and self.layout.frozen_at is not None  # its part is written
        if self.engine.checkpointer is None or not self.files.on or self.fenced or moved:
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
        self._main_port.shutting_down()
        self.side_ports.shutting_down()
        self.engine.stop()
        if self.exporter is not None:
            self.exporter.close()
        self.reductions.stop()
        if self.claims is not None:
            self.claims.stop()
        self._main_port.stop(grace)
        self._data_port.stop()
        self.engine.tables.close()
        if self._link is not None:
            self._link.close()
        self.side_ports.stop()
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
        with stop_signals.recorded() as received:
            try:
                stop_signals.serve_until(self._finished, received, f"pserver {self.endpoint}")
                # SIGTERM, Ctrl-C or the end of training: probes see the shutdown at once, while the
                # last checkpoint is written; then keep the model.
                self.side_ports.shutting_down()
                self.checkpoint()
            finally:
                # A fenced process answers nothing worth waiting for; one that moved, only refusals.
                self.stop(grace=1.0 if self.fenced or (self.layout and self.layout.moved) else 5.0)
        if self.fenced:
            raise LostLead(
                f"pserver {self.endpoint} lost the lead of shard {self.program.shard} and stopped; "
                f"start it again to rejoin as the backup"
            )
        moved = self.layout.moved if self.layout is not None else None
        if moved is not None and self.endpoint in moved.processes:  # serves the next one
            ParameterServer(program_in(self.program, moved), None, security=self.security).serve()

    def __enter__(self) -> "ParameterServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop(grace=1.0)
