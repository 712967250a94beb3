"""Free TCP ports for the processes a test or a benchmark starts.

``free_ports`` is ps-launch's own (:func:`trainer.launch.plan.free_ports`): ``n`` distinct ports the OS
reports free on a host address, all held open until every one is picked, then released for the roles to
bind. The tests and benchmarks need exactly that, so they use the launcher's rather than a copy.
"""

from __future__ import annotations

from trainer.launch.plan import free_ports

__all__ = ["free_ports"]
