"""Free TCP ports on loopback for the processes a benchmark starts."""

from __future__ import annotations

import contextlib
import socket
from typing import List


def free_ports(n: int) -> List[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 right now (all held open while choosing)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
