"""Where a job's roles run among hosts (``netns.Hosts``), and the ps-launch command each host runs.

A layout places pserver ``i`` on host ``pservers[i]`` and trainer ``j`` on host
``trainers[j]`` (hosts numbered from 1). Named layouts:

- ``split`` (``split:P+T``): P pserver hosts, then T trainer hosts (default 2 + 2): every push and
  pull crosses the network, as when pservers get machines of their own.
- ``colocated`` (``colocated:N``): N hosts each running one pserver and one trainer (default 4),
  as Paddle's manuals recommend; a trainer's blocks on its own host's pserver stay on that host.
- ``pair``: two pservers on host 1, two trainers on host 2 (what ``bench_veth`` measured first).

:func:`per_host_commands` is the multi-host recipe users run (docs/operations.md, "Jobs across
hosts"): the same ``ps-launch --servers ... --workers ...`` on every host, each with ``--host``
its own address, so each starts only its own roles.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple


@dataclass(frozen=True)
class HostLayout:
    """Roles on hosts: ``pservers[i]`` is the host of pserver ``i``, ``trainers[j]`` of trainer ``j``."""

    name: str
    pservers: Tuple[int, ...]
    trainers: Tuple[int, ...]

    @property
    def hosts(self) -> int:
        """How many hosts the layout uses (1..hosts)."""
        return max(self.pservers + self.trainers)

    def roles_on(self, host: int) -> Tuple[List[int], List[int]]:
        """(pserver indexes, trainer ids) that run on ``host``."""
        return (
            [i for i, h in enumerate(self.pservers) if h == host],
            [j for j, h in enumerate(self.trainers) if h == host],
        )


def parse_layout(text: str) -> HostLayout:
    """``split``, ``split:P+T``, ``colocated``, ``colocated:N`` or ``pair`` as a :class:`HostLayout`; else
    ValueError."""
    if text.strip() == "pair":
        return HostLayout("pair", (1, 1), (2, 2))
    m = re.fullmatch(r"(split|colocated)(?::(\d+)(?:\+(\d+))?)?", text.strip())
    if not m:
        raise ValueError(f"a layout is split, split:P+T, colocated, colocated:N or pair; got {text!r}")
    kind, a, b = m.groups()
    if kind == "split":
        if a is not None and b is None:
            raise ValueError(f"split takes P+T (pserver hosts + trainer hosts), got {text!r}")
        p, t = (int(a), int(b)) if a is not None else (2, 2)
        if p < 1 or t < 1:
            raise ValueError(f"split needs at least one pserver host and one trainer host, got {text!r}")
        return HostLayout(text, tuple(range(1, p + 1)), tuple(range(p + 1, p + t + 1)))
    if b is not None:
        raise ValueError(f"colocated takes one number of hosts, got {text!r}")
    n = int(a) if a is not None else 4
    if n < 1:
        raise ValueError(f"colocated needs at least one host, got {text!r}")
    return HostLayout(text, tuple(range(1, n + 1)), tuple(range(1, n + 1)))


def endpoints(layout: HostLayout, ip: Callable[[int], str], port: int) -> List[str]:
    """Every pserver's ``ip:port``: pserver ``i`` at ``port + i`` on its host (distinct even where hosts
    repeat)."""
    return [f"{ip(h)}:{port + i}" for i, h in enumerate(layout.pservers)]


def per_host_commands(
    layout: HostLayout,
    ip: Callable[[int], str],
    port: int,
    log_dir: Callable[[int], str],
    script: Sequence[str],
    launcher: Sequence[str] = (sys.executable, "-m", "trainer.launch"),
) -> Dict[int, List[str]]:
    """{host: the ps-launch command it runs} for the hosts that run a role: the same cluster on every host.

    ``ip(host)`` is a host's address, ``log_dir(host)`` where its launcher writes its roles' logs,
    ``script`` the training script and its arguments.
    """
    servers = ",".join(endpoints(layout, ip, port))
    workers = ",".join(ip(h) for h in layout.trainers)
    out = {}
    for host in range(1, layout.hosts + 1):
        if any(layout.roles_on(host)):
            out[host] = [
                *launcher,
                "--servers",
                servers,
                "--workers",
                workers,
                "--host",
                ip(host),
                "--log_dir",
                log_dir(host),
                *script,
            ]
    return out
