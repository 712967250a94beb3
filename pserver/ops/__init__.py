"""What operators see of a running pserver: its side ports and ``ps-stat``.

``metrics.py`` is the Prometheus ``/metrics`` collector (read at scrape time)
and its HTTP server; ``health.py`` the health-only gRPC port for Kubernetes'
probes; ``ports.py`` the side-port settings (``PS_METRICS_PORT``,
``PS_HEALTH_PORT``); ``side_ports.py`` their servers, started and stopped in
order; ``stat_cli.py`` the ``ps-stat`` command, a Stats RPC client.
:mod:`pserver.server` starts the side ports; import the modules themselves,
this package exports nothing.
"""
