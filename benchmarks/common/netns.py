"""Two "hosts" on one machine: two network namespaces joined by a veth pair (real TCP between them).

Used by ``bench_veth``; usable on its own::

    from benchmarks.common.netns import TwoHosts
    with TwoHosts(rate="10gbit", delay="0.1ms") as hosts:   # shaping is optional
        before = hosts.counters(2)
        subprocess.run(hosts.cmd(2, "ping", "-c", "1", hosts.ip(1)))
        moved = hosts.moved(before, hosts.counters(2))       # {"rx_bytes": ..., "tx_bytes": ...}

Namespace 1 gets ``10.231.N.1/24`` on its veth end, namespace 2 ``10.231.N.2/24``
(``N`` from the pid), both with loopback up. Names carry this process's pid
(``bv-h1-PID``, ``bvv1-PID``: at most 15 characters for a veth), so runs of
several people at once do not meet. Leaving the ``with`` block (also on an
error, Ctrl-C or SIGTERM turned into SystemExit) deletes both namespaces and
any veth end still in the root namespace; processes started inside must be
stopped first (a namespace lives on while a process holds it).

``python -m benchmarks.common.netns cleanup`` removes namespaces and veths left by a
run that was SIGKILLed (only those whose pid no longer lives);
``python -m benchmarks.common.netns check [rate=1gbit] [delay=1ms]`` creates a pair,
sends 16 MiB over TCP from namespace 2 to namespace 1 and logs the counters.
Needs root (CAP_NET_ADMIN + CAP_SYS_ADMIN) and iproute2; a delay needs the
kernel's ``sch_netem`` (a rate alone falls back to ``tbf`` without it).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

log = logging.getLogger("netns")

PREFIX_NS = "bv-h"      # bv-h1-PID, bv-h2-PID
PREFIX_VETH = "bvv"     # bvv1-PID, bvv2-PID
SUBNET_BASE = "10.231"
COUNTERS = ("rx_bytes", "tx_bytes")


class NetnsError(RuntimeError):
    """Setting up, using or removing the namespaces failed; the message names the command."""


def _run(cmd: Sequence[str], timeout: float = 20, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``cmd`` (no shell), capturing output; raise NetnsError if it fails and ``check``."""
    try:
        r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        if check:
            raise NetnsError(f"`{' '.join(cmd)}` failed: {e}") from None
        return subprocess.CompletedProcess(cmd, -1, "", str(e))
    if check and r.returncode != 0:
        raise NetnsError(f"`{' '.join(cmd)}` exited {r.returncode}: {r.stderr.strip()}")
    return r


class TwoHosts:
    """Two network namespaces joined by a veth pair; a context manager that always tears down.

    ``host`` arguments are 1 or 2. ``rate`` / ``delay`` (tc netem syntax,
    e.g. ``"10gbit"``, ``"0.1ms"``) shape both veth ends' egress, so each
    direction sees the rate and one-way delay (a round trip: twice the delay).
    """

    def __init__(self, tag: Optional[int] = None, rate: Optional[str] = None, delay: Optional[str] = None):
        tag = os.getpid() if tag is None else tag
        self.tag = tag
        self.ns = {1: f"{PREFIX_NS}1-{tag}", 2: f"{PREFIX_NS}2-{tag}"}
        self.veth = {1: f"{PREFIX_VETH}1-{tag}", 2: f"{PREFIX_VETH}2-{tag}"}
        self.subnet = f"{SUBNET_BASE}.{tag % 250}"
        self.rate, self.delay = rate, delay
        self._created: List[str] = []

    # -- set up / tear down ---------------------------------------------------

    def __enter__(self) -> "TwoHosts":
        try:
            self.setup()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def ip(self, host: int) -> str:
        """The address of ``host``'s veth end."""
        return f"{self.subnet}.{host}"

    def setup(self) -> None:
        """Create both namespaces, the veth pair, addresses, links up, optional netem shaping."""
        for host in (1, 2):
            _run(["ip", "netns", "add", self.ns[host]])
            self._created.append(self.ns[host])
        _run(self.cmd(1, "true"))  # `ip netns exec` must be able to remount /sys here
        _run(["ip", "link", "add", self.veth[1], "type", "veth", "peer", "name", self.veth[2]])
        for host in (1, 2):
            _run(["ip", "link", "set", self.veth[host], "netns", self.ns[host]])
        for host in (1, 2):
            _run(["ip", "-n", self.ns[host], "addr", "add", f"{self.ip(host)}/24", "dev", self.veth[host]])
            _run(["ip", "-n", self.ns[host], "link", "set", "lo", "up"])
            _run(["ip", "-n", self.ns[host], "link", "set", self.veth[host], "up"])
        shaping = self.qdisc()
        if shaping:
            for host in (1, 2):
                _run(["tc", "-n", self.ns[host], "qdisc", "add", "dev", self.veth[host], "root", *shaping])
        log.info("namespaces %s (%s on %s) and %s (%s on %s) up%s", self.ns[1], self.ip(1), self.veth[1],
                 self.ns[2], self.ip(2), self.veth[2],
                 f", veth shaped: {' '.join(shaping)}" if shaping else "")

    def qdisc(self) -> List[str]:
        """The tc qdisc (``root`` onwards) that shapes each veth end, or [] when not shaped.

        ``netem rate R delay D`` when the kernel has ``sch_netem``. A rate
        alone falls back to ``tbf`` (token bucket: burst the larger of 512 KiB
        and 1 ms at the rate, as veth hands over 64 KiB GSO segments) when
        netem is missing; a delay needs netem and raises NetnsError without it.
        """
        if not (self.rate or self.delay):
            return []
        netem = ["netem"] + (["rate", self.rate] if self.rate else []) + (["delay", self.delay] if self.delay else [])
        probe = _run(["tc", "-n", self.ns[1], "qdisc", "add", "dev", "lo", "root", *netem], check=False)
        if probe.returncode == 0:
            _run(["tc", "-n", self.ns[1], "qdisc", "del", "dev", "lo", "root"], check=False)
            return netem
        if self.delay:
            raise NetnsError(f"--delay needs the netem qdisc, which this kernel lacks: {probe.stderr.strip()}")
        m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", self.rate.lower())
        if not m:
            raise NetnsError(f"netem is missing and the tbf fallback needs a rate like 10gbit, got {self.rate!r}")
        bytes_per_s = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)] / 8
        burst = max(512 * 1024, int(bytes_per_s * 1e-3))
        log.warning("netem missing (%s): shaping with tbf rate %s only", probe.stderr.strip(), self.rate)
        return ["tbf", "rate", self.rate, "burst", str(burst), "latency", "50ms"]

    def teardown(self) -> None:
        """Delete the namespaces made here (their veth ends go with them) and any stray veth end."""
        for ns in self._created:
            r = _run(["ip", "netns", "del", ns], check=False)
            if r.returncode != 0:
                log.warning("could not delete namespace %s: %s", ns, r.stderr.strip())
        self._created.clear()
        for dev in self.veth.values():  # setup may have stopped before moving an end
            if _run(["ip", "link", "show", dev], check=False).returncode == 0:
                _run(["ip", "link", "del", dev], check=False)

    # -- use ------------------------------------------------------------------

    def cmd(self, host: int, *argv: str) -> List[str]:
        """``argv`` run inside ``host``'s namespace (``ip netns exec``: the process is the command's own)."""
        return ["ip", "netns", "exec", self.ns[host], *argv]

    def counters(self, host: int) -> Dict[str, int]:
        """Bytes received and sent so far by ``host``'s veth end: ``{"rx_bytes": .., "tx_bytes": ..}``."""
        r = _run(["ip", "-n", self.ns[host], "-s", "-j", "link", "show", "dev", self.veth[host]])
        stats = json.loads(r.stdout)[0]["stats64"]
        return {"rx_bytes": int(stats["rx"]["bytes"]), "tx_bytes": int(stats["tx"]["bytes"])}

    @staticmethod
    def moved(before: Dict[str, int], after: Dict[str, int]) -> Dict[str, int]:
        """The counters' growth between two :meth:`counters` readings."""
        return {k: after[k] - before[k] for k in COUNTERS}

    def tcp_connections(self, host: int) -> int:
        """Established TCP connections of ``host``'s namespace to or from the other host (over the veth)."""
        r = _run(["ss", "-H", "-t", "-n", "-N", self.ns[host], "state", "established", "dst", self.ip(3 - host)],
                 check=False)
        return len(r.stdout.splitlines()) if r.returncode == 0 else -1

    def sysfs_counter_paths(self, host: int) -> Dict[str, str]:
        """Where a process inside ``host``'s namespace reads its veth end's counters (sysfs)."""
        return {k: f"/sys/class/net/{self.veth[host]}/statistics/{k}" for k in COUNTERS}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> List[str]:
    """Remove namespaces and root-namespace veths of this module whose creating pid is gone; their names."""
    removed = []
    listing = _run(["ip", "netns", "list"], check=False).stdout
    for name in re.findall(rf"^({PREFIX_NS}[12]-(\d+))", listing, flags=re.M):
        ns, pid = name[0], int(name[1])
        if not _pid_alive(pid) and _run(["ip", "netns", "del", ns], check=False).returncode == 0:
            removed.append(ns)
    links = _run(["ip", "-o", "link", "show"], check=False).stdout
    for dev, pid in re.findall(rf"^\d+: ({PREFIX_VETH}[12]-(\d+))[@:]", links, flags=re.M):
        if not _pid_alive(int(pid)) and _run(["ip", "link", "del", dev], check=False).returncode == 0:
            removed.append(dev)
    return removed


# `check`: a TCP sink in namespace 1 (prints the bytes it got) and a source of 16 MiB in namespace 2.
_SINK = ("import socket,sys; s=socket.create_server((sys.argv[1], 7000)); c=s.accept()[0]; n=0\n"
         "while (b := c.recv(1 << 20)): n += len(b)\nprint(n)")
_SOURCE = ("import socket,sys,time\nfor _ in range(100):\n"
           "  try: c=socket.create_connection((sys.argv[1], 7000)); break\n"
           "  except OSError: time.sleep(0.05)\nc.sendall(bytes(16 << 20)); c.close()")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.common.netns",
                                description=__doc__.splitlines()[0] + " Needs root.")
    p.add_argument("command", nargs="?", default="check", choices=["check", "cleanup"],
                   help="check (default): a pair, 16 MiB over TCP across it; cleanup: remove what a "
                        "SIGKILLed run left")
    p.add_argument("options", nargs="*", metavar="KEY=VALUE",
                   help="check: rate=R (e.g. 1gbit) and delay=D (e.g. 1ms) shape the veth")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "cleanup":
        removed = cleanup_stale()
        log.info("removed %s", ", ".join(removed) if removed else "nothing")
        return 0
    if any("=" not in o for o in args.options):
        p.error(f"check takes rate=R and delay=D, got {args.options}")
    try:
        return _check(dict(o.split("=", 1) for o in args.options))
    except NetnsError as e:
        log.error("%s", e)
        return 1


def _check(opts: Dict[str, str]) -> int:
    """`check`: 16 MiB over TCP from namespace 2 to namespace 1, shaped by ``opts`` (rate, delay)."""
    with TwoHosts(rate=opts.get("rate"), delay=opts.get("delay")) as hosts:
        before, t0 = hosts.counters(2), time.monotonic()
        server = subprocess.Popen(hosts.cmd(1, sys.executable, "-c", _SINK, hosts.ip(1)),
                                  stdout=subprocess.PIPE, text=True)
        try:
            _run(hosts.cmd(2, sys.executable, "-c", _SOURCE, hosts.ip(1)), timeout=60)
            got = server.communicate(timeout=30)[0].strip()
        finally:
            server.kill()
            server.wait()
        log.info("%s bytes sent %s -> %s over TCP in %.2f s (processes' start included); "
                 "the veth end of host 2 moved %s", got, hosts.ip(2), hosts.ip(1),
                 time.monotonic() - t0, hosts.moved(before, hosts.counters(2)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
