"""Which side ports a pserver opens besides its endpoint: Prometheus metrics and the probe-only health port.

Each comes from its config field when that is set (in code, or by a
``ps-server --metrics_port`` / ``--health_port`` flag), else from the
environment variable a deployment sets (Kubernetes manifests set
``PS_METRICS_PORT`` and ``PS_HEALTH_PORT``), else it is off. A field wins over
the variable: a value written for this job is more specific than one the pod
template gives every process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional, Tuple

METRICS_PORT_VAR = "PS_METRICS_PORT"
HEALTH_PORT_VAR = "PS_HEALTH_PORT"


def port_setting(field: Optional[int], var: str, environ: Mapping[str, str]) -> Optional[int]:
    """The port to open: ``field`` if not None, else ``environ[var]`` if set and non-empty, else None.

    A variable that is not a port number in [0, 65535] raises ValueError naming it.
    """
    if field is not None:
        return field
    text = environ.get(var, "").strip()
    if not text:
        return None
    if not text.isdigit() or not 0 <= int(text) < 65536:
        raise ValueError(f"{var}={environ[var]!r} is not a port number in [0, 65535]")
    return int(text)


def split_host(endpoint: str) -> str:
    """The host part of ``host:port`` (``[v6]:port`` gives ``v6``): where the side ports bind too."""
    host = endpoint.rpartition(":")[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


@dataclass(frozen=True)
class SidePorts:
    """The metrics and health ports a pserver opens (None: off), resolved once at start-up."""

    metrics: Optional[int]
    health: Optional[int]

    @classmethod
    def resolve(
        cls,
        metrics_field: Optional[int],
        health_field: Optional[int],
        endpoint: str,
        environ: Mapping[str, str] = os.environ,
    ) -> "SidePorts":
        """Resolve both ports; ValueError when a variable is malformed or two ports coincide.

        Two side ports equal to each other or to the endpoint's port could
        never both bind; refusing here names the settings instead of failing
        at bind time with a bare "address in use".
        """
        ports = cls(
            port_setting(metrics_field, METRICS_PORT_VAR, environ),
            port_setting(health_field, HEALTH_PORT_VAR, environ),
        )
        main = endpoint.rpartition(":")[2]
        named: Tuple[Tuple[str, Optional[int]], ...] = (
            (f"the metrics port (metrics_port / {METRICS_PORT_VAR})", ports.metrics),
            (f"the health port (health_port / {HEALTH_PORT_VAR})", ports.health),
        )
        for what, port in named:
            if port and main.isdigit() and port == int(main):
                raise ValueError(
                    f"{what} is {port}, the port of the pserver's endpoint {endpoint}; give it another port"
                )
        if ports.metrics and ports.metrics == ports.health:
            raise ValueError(
                f"{named[0][0]} and {named[1][0]} are both {ports.metrics}; give each its own port"
            )
        return ports
