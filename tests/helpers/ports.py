"""Free loopback ports for the roles a test starts."""

from __future__ import annotations

import socket
from typing import List


def free_ports(n: int) -> List[int]:
    """``n`` distinct ports the OS reports free on 127.0.0.1 (all held open until every one is picked)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
