"""This host as ps-launch sees it: its addresses, which entries of ``--servers`` / ``--workers`` are its own,
and free ports to give its roles."""

from __future__ import annotations

import random
import socket
from typing import Callable, List, Optional, Tuple

# The ports the kernel gives binds to port 0 and outgoing connections (Linux's default if unknown).
_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_LOWEST = 10000  # ports below are left to well-known services


def ephemeral_range() -> Tuple[int, int]:
    """(first, last) port the kernel hands out on its own (to a bind to port 0, an outgoing connection)."""
    try:
        with open(_EPHEMERAL_RANGE) as f:
            first, last = (int(x) for x in f.read().split())
        return first, last
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(n: int, host: str = "127.0.0.1") -> List[int]:
    """``n`` distinct ports free on ``host``, outside the kernel's ephemeral range (all held open until every
    one is picked).

    A role binds its port a second or more after this picks it. A port of the ephemeral range could be
    taken meanwhile by any socket bound to port 0 (a pserver's data port, another job's gRPC server) or
    any outgoing connection: outside it, only another explicit pick can, and a random one rarely does.
    Where the range leaves no room, the kernel's own choice (port 0) serves.
    """
    first, last = ephemeral_range()
    spans = [span for span in ((_LOWEST, first - 1), (last + 1, 65535)) if span[1] - span[0] >= 1000]
    rng = random.Random()
    socks: List[socket.socket] = []
    try:
        for _ in range(n):
            socks.append(_bind_free(host, spans, rng, {s.getsockname()[1] for s in socks}))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _bind_free(host: str, spans, rng: random.Random, taken) -> socket.socket:
    """A socket bound on ``host`` to a free port of ``spans`` not in ``taken`` (port 0 if none is found)."""
    for _ in range(200 if spans else 0):
        lo, hi = rng.choice(spans)
        port = rng.randint(lo, hi)
        if port in taken:
            continue
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind((host, port))
            return s
        except OSError:
            s.close()
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((host, 0))
    return s


def _resolve(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def local_addresses() -> set:
    """IPv4 addresses of this host: loopback, the hostname's addresses and every interface's (Linux)."""
    addrs = {"127.0.0.1"}
    try:
        addrs.update(info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET))
    except OSError:
        pass
    try:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                try:  # SIOCGIFADDR; fails for an interface without an IPv4 address
                    packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
                    addrs.add(socket.inet_ntoa(packed[20:24]))
                except OSError:
                    pass
    except (ImportError, OSError):
        pass
    return addrs


def host_matcher(host: Optional[str] = None) -> Callable[[str], bool]:
    """A predicate "does this ip (or hostname) belong to this host?" for ``--host`` (None: auto-detect)."""
    if host:
        mine = _resolve(host)
        return lambda h: h == host or _resolve(h) == mine
    local = local_addresses()
    return lambda h: h.startswith("127.") or h == "localhost" or _resolve(h) in local
