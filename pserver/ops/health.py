"""The probe-only health port: ``grpc.health.v1`` on a gRPC server of its own, for Kubernetes.

Kubernetes' built-in gRPC probe can send neither an auth token nor (reliably)
TLS, so it cannot ask the pserver's main port once ``PS_AUTH_TOKEN`` is set.
Rather than let health calls through the token check on the main port (which
would make the check's coverage depend on a method list), the pserver opens a
second server that registers nothing but the health service, has no
interceptors and listens in plaintext: what it tells anyone is whether the
pserver is ready. The training service, and the health service on the main
port, stay behind the token.
"""

from __future__ import annotations

import logging
from concurrent import futures
from typing import Iterable, Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

log = logging.getLogger(__name__)


class HealthPort:
    """A health-only gRPC server on ``host:port``: NOT_SERVING until :meth:`serving`, again at
    :meth:`stop`."""

    def __init__(self, host: str, port: int, services: Iterable[str] = ("",)):
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.services = tuple(services)
        self.port: Optional[int] = None
        self._health = health.HealthServicer(experimental_non_blocking=True)
        self._server: Optional[grpc.Server] = None

    def start(self) -> int:
        """Bind and start (answering NOT_SERVING); returns the bound port. OSError if it cannot bind."""
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="pserver-health"),
            options=[("grpc.so_reuseport", 0)],
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        for service in self.services:
            self._health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        try:
            port = server.add_insecure_port(self.address)
        except RuntimeError as e:
            port, detail = 0, str(e)
        else:
            detail = "bind returned port 0"
        if port == 0:
            raise OSError(f"cannot bind the health port {self.address} ({detail}); is the port in use?")
        server.start()
        self._server, self.port = server, port
        return port

    def serving(self) -> None:
        """Report SERVING: the pserver is ready (its blocks loaded or resumed, its main port bound)."""
        for service in self.services:
            self._health.set(service, health_pb2.HealthCheckResponse.SERVING)

    def shutting_down(self) -> None:
        """Report NOT_SERVING from now on (idempotent); the port keeps answering until :meth:`stop`."""
        self._health.enter_graceful_shutdown()

    def stop(self, grace: float = 0.0) -> None:
        """NOT_SERVING, then close the port."""
        self.shutting_down()
        if self._server is not None:
            self._server.stop(grace).wait()
            self._server = None
