"""This host as ps-launch sees it: its addresses, which entries of ``--servers`` / ``--workers`` are its own,
and free ports to give its roles."""

from __future__ import annotations

import socket
from typing import Callable, List, Optional


def free_ports(n: int, host: str = "127.0.0.1") -> List[int]:
    """``n`` distinct ports the OS reports free on ``host`` (all held open until every one is picked)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


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
