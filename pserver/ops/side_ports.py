"""The servers of a pserver's side ports: the probe-only health port and the Prometheus metrics server.

Which ports (:class:`~.ports.SidePorts`) is settled when the pserver is built; the servers start
before the main port (health answering NOT_SERVING until the main port serves) and stop after it
(the metrics server last). Both bind on the endpoint's host.
"""

from __future__ import annotations

import logging
from typing import Optional

from psproto.wire import SERVICE

from .health import HealthPort
from .metrics import MetricsServer, PserverCollector
from .ports import SidePorts, split_host

log = logging.getLogger(__name__)


class SidePortServers:
    """The health port and the metrics server of the pserver at ``endpoint`` (each off when its port is).

    After :meth:`start`, :attr:`health_port` and :attr:`metrics_port` hold the ports bound (None: off).
    """

    def __init__(self, ports: SidePorts, endpoint: str):
        self.ports = ports
        self.endpoint = endpoint
        self.health_port: Optional[int] = None
        self.metrics_port: Optional[int] = None
        self._health: Optional[HealthPort] = None
        self._metrics: Optional[MetricsServer] = None

    def start(self, collector: PserverCollector) -> None:
        """The health port (answering NOT_SERVING until :meth:`serving`), then the metrics server reading
        ``collector``; OSError naming the address if a port cannot be bound."""
        host = split_host(self.endpoint)
        if self.ports.health is not None:
            self._health = HealthPort(host, self.ports.health, ("", SERVICE))
            self.health_port = self._health.start()
            log.info(
                "pserver %s: health port %d on %s (grpc.health.v1 only, plaintext, no auth token)",
                self.endpoint,
                self.health_port,
                host,
            )
        if self.ports.metrics is not None:
            self._metrics = MetricsServer(collector, self.endpoint)
            self.metrics_port = self._metrics.start(host, self.ports.metrics)
            log.info(
                "pserver %s: Prometheus metrics at http://%s:%d/metrics",
                self.endpoint,
                f"[{host}]" if ":" in host else host,
                self.metrics_port,
            )

    def serving(self) -> None:
        """The main port serves: the health port answers SERVING."""
        if self._health is not None:
            self._health.serving()

    def shutting_down(self) -> None:
        """Probes see the shutdown at once: the health port answers NOT_SERVING until it stops."""
        if self._health is not None:
            self._health.shutting_down()

    def stop(self) -> None:
        """Close the health port, then stop the metrics server (no more barrier waits observed)."""
        if self._health is not None:
            self._health.stop()
        metrics, self._metrics = self._metrics, None
        if metrics is not None:
            metrics.stop()

    def observe_barrier_wait(self, seconds: float) -> None:
        """The engine's ``on_wait``: a sync step's wait, into the barrier histogram while metrics are served.

        The histogram lives with the metrics server, which starts and stops
        with the side ports; without it the wait is not recorded.
        """
        metrics = self._metrics  # read once: stopping unsets it
        if metrics is not None:
            metrics.barrier_wait.observe(seconds)
