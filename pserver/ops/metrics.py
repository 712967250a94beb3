"""Prometheus metrics of one pserver, served over HTTP at ``/metrics`` on its metrics port.

Most values are read at scrape time from what the pserver keeps anyway (the
servicer's counters and the engine's :class:`~pserver.engine.stats.PserverStats`, the
same one the Stats RPC answers from), by a custom collector: nothing is counted
twice on the request path. The one exception is the barrier wait histogram, observed where a sync
wait ends, outside the engine's lock.

Every pserver has a registry of its own (several pservers in one process, as
in tests, do not clash), and every series carries an ``endpoint`` label.
"""

from __future__ import annotations

import logging
import time
from typing import Iterator, Optional

from prometheus_client import (
    CollectorRegistry,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from transpiler.layout.routing import ROUTING_VERSION

log = logging.getLogger(__name__)

# Seconds; a sync step's wait spans a few milliseconds (fast trainers) to the barrier_timeout (a lost one).
BARRIER_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    float("inf"),
)
TRAINER_STATES = ("alive", "dropped", "closed")


class PserverCollector(Collector):
    """Reads one pserver's state at every scrape and yields it as metric families.

    ``servicer`` is the pserver's :class:`~pserver.rpc.service.servicer.PserverServicer`
    (its counters, and its engine's stats); ``auth`` the token interceptor
    whose refusals count as reason "auth", or None.
    """

    def __init__(self, servicer, shard: int, pservers: int, auth=None):
        self.servicer = servicer
        self.shard = shard
        self.pservers = pservers
        self.auth = auth
        self.start_time = time.time() - (time.monotonic() - servicer.started)

    def collect(self) -> Iterator[Metric]:
        """One sample of every metric; the engine's lock is held only to copy the roster."""
        svc = self.servicer
        snap = svc.engine.stats()
        ep = [svc.endpoint]
        states = {"alive": len(snap.alive), "dropped": len(snap.dropped), "closed": len(snap.closed)}
        c = svc.counters
        with c.lock:
            traffic = (c.pushes, c.prefetches, c.bytes_in, c.bytes_out, c.dropped_pushes)
            by_trainer = dict(c.pushes_by_trainer)
            heartbeats, heartbeats_by_trainer = c.heartbeats, dict(c.heartbeats_by_trainer)
            refused = dict(c.refused_by)
        if self.auth is not None:
            refused[("auth", "UNAUTHENTICATED")] = self.auth.refused

        info = GaugeMetricFamily(
            "ps_pserver_info",
            "This pserver: mode, shard and job size (value 1)",
            labels=["endpoint", "mode", "shard", "pservers", "trainers"],
        )
        info.add_metric(
            [
                *ep,
                "sync" if snap.sync_mode else "async",
                str(self.shard),
                str(self.pservers),
                str(snap.trainers),
            ],
            1,
        )
        yield info
        yield _gauge("ps_step", "Updates applied (sync mode: the step the pserver is at)", ep, snap.step)
        yield _gauge(
            "ps_layout_epoch",
            "The layout this pserver serves (0: as transpiled)",
            ep,
            svc.checks.layout_epoch,
        )
        yield _gauge("ps_routing_version", "How table ids are routed to pservers", ep, ROUTING_VERSION)
        layout = svc.checks.layout_status()
        yield _gauge(
            "ps_layout_change_in_progress",
            "1 while the job changes its pserver count",
            ep,
            int(bool(layout.change)),
        )
        yield _gauge(
            "ps_layout_parts_moved",
            "The change in progress: current pservers whose state is written (of ps_layout_parts_to_move)",
            ep,
            layout.moved,
        )
        yield _gauge(
            "ps_layout_parts_to_move",
            "The change in progress: current pservers to write out",
            ep,
            layout.to_move,
        )
        yield _gauge(
            "ps_layout_change_seconds",
            "How long the job's last change of pserver count took",
            ep,
            layout.last_change_s,
        )
        trainers = GaugeMetricFamily(
            "ps_trainers",
            "Trainers by state: alive (joined, heard from), dropped (silent past heartbeat_timeout), closed",
            labels=["endpoint", "state"],
        )
        for state in TRAINER_STATES:
            trainers.add_metric([*ep, state], states[state])
        yield trainers
        yield _gauge("ps_trainers_expected", "Trainers the job was transpiled for", ep, snap.trainers)
        yield _counter(
            "ps_pushes", "Pushes received (gradients of one step from one trainer)", ep, traffic[0]
        )
        yield _counter(
            "ps_dropped_pushes",
            "Backup trainers: pushes of trainers dropped from their step (left out)",
            ep,
            traffic[4],
        )
        yield _counter("ps_prefetches", "Prefetches (table row lookups) answered", ep, traffic[1])
        yield _counter("ps_received_bytes", "Tensor bytes received (gradients, ids)", ep, traffic[2])
        yield _counter("ps_sent_bytes", "Tensor bytes sent (parameters, rows)", ep, traffic[3])
        per_trainer = CounterMetricFamily(
            "ps_trainer_pushes",
            "Pushes counted per trainer (a node counts once)",
            labels=["endpoint", "trainer"],
        )
        for t in sorted(by_trainer):
            per_trainer.add_metric([*ep, str(t)], by_trainer[t])
        yield per_trainer
        yield _counter(
            "ps_heartbeats",
            "Heartbeats received (trainers send them only towards a pserver they were "
            "silent to for a heartbeat_interval: none in steady training)",
            ep,
            heartbeats,
        )
        beats = CounterMetricFamily(
            "ps_trainer_heartbeats",
            "Heartbeats received per trainer (a node counts once)",
            labels=["endpoint", "trainer"],
        )
        for t in sorted(heartbeats_by_trainer):
            beats.add_metric([*ep, str(t)], heartbeats_by_trainer[t])
        yield beats
        refusals = CounterMetricFamily(
            "ps_refused_requests",
            "Requests refused, by reason (the refusal's kind; "
            "auth: no or wrong token; internal: a bug) and gRPC status",
            labels=["endpoint", "reason", "code"],
        )
        for (reason, code), n in sorted(refused.items()):
            refusals.add_metric([*ep, reason, code], n)
        yield refusals
        yield _gauge("ps_blocks", "Dense parameter blocks held", ep, snap.blocks)
        yield _gauge(
            "ps_block_bytes", "Bytes of the dense blocks held (parameters only)", ep, snap.block_bytes
        )
        yield _gauge(
            "ps_table_rows",
            "Rows held by this pserver's distributed table shards (in memory and on disk)",
            ep,
            snap.table_rows,
        )
        yield _gauge(
            "ps_table_bytes", "Bytes those shards hold (ids, rows, optimizer state)", ep, snap.table_bytes
        )
        yield from _table_metrics(ep, snap.tables)
        if svc.replica is not None:
            yield from _replica_metrics(ep, svc.replica.stats())
        last = snap.checkpoint
        yield _gauge(
            "ps_checkpoint_step",
            "Step of the latest checkpoint written or loaded (-1: none)",
            ep,
            last.step if last else -1,
        )
        if last is not None:
            yield _gauge(
                "ps_checkpoint_timestamp_seconds",
                "Unix time the latest checkpoint was written or loaded",
                ep,
                last.time,
            )
            yield _gauge(
                "ps_checkpoint_age_seconds",
                "Seconds since the latest checkpoint was written or loaded",
                ep,
                max(0.0, time.time() - last.time),
            )
        yield _gauge("ps_start_time_seconds", "Unix time this pserver started", ep, self.start_time)


_LIFECYCLE_EVENTS = ("admitted", "refused", "evicted", "spilled", "promoted")


def _replica_metrics(ep, replica) -> Iterator[Metric]:
    """Hot standby: this process's role, epoch, backup and replication lag (docs/recovery.md, "Hot
    standby")."""
    info = GaugeMetricFamily(
        "ps_replica_info",
        "This process's place in its shard's replica set (value 1)",
        labels=["endpoint", "role", "primary", "backup"],
    )
    info.add_metric([*ep, replica.role, replica.primary, replica.backup], 1)
    yield info
    yield _gauge(
        "ps_replica_epoch",
        "The fencing epoch of the shard's primary as this process knows it",
        ep,
        replica.epoch,
    )
    yield _gauge(
        "ps_replica_backup_in_sync",
        "1 when the shard's backup holds every acknowledged update",
        ep,
        int(replica.backup_in_sync),
    )
    yield _gauge(
        "ps_replica_lag_messages",
        "Replication messages the backup has not acknowledged yet (primary)",
        ep,
        replica.lag,
    )
    yield _counter(
        "ps_replica_messages",
        "Replication messages sent (primary) or applied (backup)",
        ep,
        replica.replicated,
    )
    yield _counter(
        "ps_replica_digest_mismatches",
        "State digests of the primary this backup did not match",
        ep,
        replica.digest_mismatches,
    )


def _table_metrics(ep, tables) -> Iterator[Metric]:
    """Per table: rows by tier, disk bytes, and the lifecycle's counts (docs/tables.md, "Table lifecycle")."""
    rows = GaugeMetricFamily(
        "ps_table_shard_rows",
        "Rows of one table's shard on this pserver, by tier (ram, disk)",
        labels=["endpoint", "table", "tier"],
    )
    disk = GaugeMetricFamily(
        "ps_table_disk_bytes",
        "Bytes one table's disk tier uses on this pserver",
        labels=["endpoint", "table"],
    )
    events = CounterMetricFamily(
        "ps_table_lifecycle_rows",
        "Table rows by lifecycle event: admitted (created), "
        "refused (a gradient of an id not admitted yet, dropped), evicted, spilled "
        "(moved to disk), promoted (back from disk)",
        labels=["endpoint", "table", "event"],
    )
    for t in tables:
        rows.add_metric([*ep, t.table, "ram"], t.rows - t.disk_rows)
        rows.add_metric([*ep, t.table, "disk"], t.disk_rows)
        disk.add_metric([*ep, t.table], t.disk_bytes)
        for event in _LIFECYCLE_EVENTS:
            events.add_metric([*ep, t.table, event], getattr(t, event))
    yield rows
    yield disk
    yield events


def _gauge(name: str, text: str, labels, value) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, text, labels=["endpoint"])
    g.add_metric(labels, value)
    return g


def _counter(name: str, text: str, labels, value) -> CounterMetricFamily:
    c = CounterMetricFamily(name, text, labels=["endpoint"])
    c.add_metric(labels, value)
    return c


class MetricsServer:
    """A pserver's registry, its barrier wait histogram, and the HTTP server that exposes them."""

    def __init__(self, collector: PserverCollector, endpoint: str):
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(collector)
        # Process metrics (memory, CPU, open files) of this process, as the default registry would have them.
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self.barrier_wait = Histogram(
            "ps_barrier_wait_seconds",
            "Time a trainer's call waited for a sync step to be applied (the barrier); "
            "calls that found it applied are not observed",
            ["endpoint"],
            registry=self.registry,
            buckets=BARRIER_BUCKETS,
        ).labels(endpoint)
        self.endpoint = endpoint
        self.port: Optional[int] = None
        self._httpd = None
        self._thread = None

    def start(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host:port`` (0: a free port) in a daemon thread; returns the port.

        OSError naming the address when it cannot bind.
        """
        try:
            self._httpd, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise OSError(
                f"pserver {self.endpoint} cannot bind its metrics port {host}:{port} ({e}); is the "
                f"port in use or the address not on this host?"
            ) from None
        self.port = self._httpd.server_address[1]
        return self.port

    def stop(self) -> None:
        """Stop serving and release the port (idempotent)."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._thread.join(5.0)
            self._httpd = self._thread = None
