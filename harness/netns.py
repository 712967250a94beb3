"""Hosts on one machine: network namespaces on a bridge, so that roles talk over real TCP between them.

Used by ``bench_veth``, ``bench_hosts`` and tests/system/test_hosts.py; usable on its own::

    from harness.netns import Hosts
    with Hosts(4, rate="10gbit", delay="0.1ms") as hosts:        # shaping is optional
        before = hosts.counters(2)
        subprocess.run(hosts.cmd(2, "ping", "-c", "1", hosts.ip(1)))
        moved = hosts.moved(before, hosts.counters(2))       # {"rx_bytes": ..., "tx_bytes": ...}

Host ``k`` (1..N) is a namespace whose one interface, ``eth0``, has ``10.231.T.k/24``
(``T`` from the pid) and is one end of a veth pair; the other end is a port of a
bridge in a namespace of its own (the "switch"), so every host reaches every
other one, and nothing of it is in the root namespace. Loopback is up in each.
Names carry this process's pid (``bv-h1-PID``, ``bv-sw-PID``, veths ``bvh1-PID`` /
``bvs1-PID`` while in the root namespace: at most 15 characters), so runs of
several people at once do not meet. Leaving the ``with`` block (also on an error,
Ctrl-C or SIGTERM turned into SystemExit) deletes every namespace it made, and
with them the veths; processes started inside must be stopped first (a namespace
lives on while a process holds it).

Shaping (``rate``, ``delay``; tc netem syntax, e.g. ``"10gbit"``, ``"0.1ms"``) gives
every host a link of that rate each way and that one-way delay: a host's egress
carries the rate and the delay, the switch's port towards it the rate, so what
several hosts send to one is limited by that one's link too, as with real NICs.
A round trip between two hosts then takes twice the delay.

The pieces below the hosts (:func:`run`, :func:`in_ns`, :func:`clear_namespace`,
:func:`without_proxies`) also serve the namespaces tests build otherwise: a veth pair
between two namespaces (tests/system/test_two_hosts.py), one namespace joined to the
root one (``tests/helpers/partition.py``), Slurm's private namespace.

``python -m harness.netns cleanup`` removes namespaces and veths left by a
run that was SIGKILLed (only those whose pid no longer lives);
``python -m harness.netns check [hosts=2] [rate=1gbit] [delay=1ms]`` creates
the hosts, sends 16 MiB over TCP from the last host to host 1 and logs the counters.
Needs root (CAP_NET_ADMIN + CAP_SYS_ADMIN) and iproute2; a delay needs the
kernel's ``sch_netem`` (a rate alone falls back to ``tbf`` without it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

from harness.paths import pythonpath_with_repo

log = logging.getLogger("netns")

PREFIX_NS = "bv-"  # bv-h1-PID (hosts), bv-sw-PID (the switch)
PREFIX_VETH = "bv"  # bvh1-PID, bvs1-PID, while in the root namespace
IFNAME = "eth0"  # each host's interface, inside its namespace
BRIDGE = "br0"  # inside the switch's namespace
SUBNET_BASE = "10.231"
MAX_HOSTS = 32  # addresses .1 to .32; the switch's veth names stay within 15 characters
COUNTERS = ("rx_bytes", "tx_bytes")
PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "grpc_proxy", "no_proxy")


class NetnsError(RuntimeError):
    """Setting up, using or removing the namespaces failed; the message names the command."""


def run(cmd: Sequence[str], timeout: float = 20, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``cmd`` (no shell), capturing its output as text; raise NetnsError if it fails and ``check``.

    Without ``check``, a failure to start or a timeout reads as exit -1.
    """
    try:
        r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        if check:
            raise NetnsError(f"`{' '.join(cmd)}` failed: {e}") from None
        return subprocess.CompletedProcess(cmd, -1, "", str(e))
    if check and r.returncode != 0:
        raise NetnsError(f"`{' '.join(cmd)}` exited {r.returncode}: {r.stderr.strip()}")
    return r


def in_ns(ns: str, *cmd: str) -> List[str]:
    """``cmd`` run inside network namespace ``ns`` (``ip netns exec`` execs it: the process is the command's
    own)."""
    return ["ip", "netns", "exec", ns, *cmd]


def clear_namespace(ns: str, timeout: float = 5.0) -> None:
    """SIGKILL every process left in network namespace ``ns``, then delete it; never raises.

    Only for a namespace the caller created: everything in it is the caller's. Processes that
    left their starter's session (slurmstepd, job tasks) are found by ``ip netns pids``; killing
    is repeated until the namespace is empty, because a dying process's children may appear
    after the first listing.
    """
    deadline = time.monotonic() + timeout
    while True:
        r = run(["ip", "netns", "pids", ns], timeout=10, check=False)
        pids = [int(p) for p in r.stdout.split()] if r.returncode == 0 else []
        if not pids or time.monotonic() > deadline:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)  # poll interval: a SIGKILLed process leaves the namespace asynchronously
    run(["ip", "netns", "del", ns], timeout=10, check=False)


def without_proxies(env: Dict[str, str]) -> Dict[str, str]:
    """``env`` without proxy variables: gRPC and etcd's HTTP client would send 10.231.x.x to a proxy."""
    return {k: v for k, v in env.items() if k.lower() not in PROXY_VARS}


def host_env(**extra: str) -> Dict[str, str]:
    """The environment of a process started in a host: this one :func:`without_proxies`, the repository
    first on PYTHONPATH, output unbuffered, and ``extra``."""
    env = without_proxies(dict(os.environ))
    return {**env, "PYTHONPATH": pythonpath_with_repo(), "PYTHONUNBUFFERED": "1", **extra}


def shaping_qdisc(rate: Optional[str], delay: Optional[str], netem: bool) -> List[str]:
    """The tc qdisc (``root`` onwards) for ``rate`` and ``delay``, or [] when neither is set.

    ``netem rate R delay D`` when the kernel has ``sch_netem`` (``netem``). A
    rate alone falls back to ``tbf`` (token bucket: burst the larger of 512 KiB
    and 1 ms at the rate, as veth hands over 64 KiB GSO segments); a delay
    needs netem and raises NetnsError without it.
    """
    if not (rate or delay):
        return []
    if netem:
        return ["netem"] + (["rate", rate] if rate else []) + (["delay", delay] if delay else [])
    if delay:
        raise NetnsError("a delay needs the netem qdisc, which this kernel lacks")
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if not m:
        raise NetnsError(f"netem is missing and the tbf fallback needs a rate like 10gbit, got {rate!r}")
    bytes_per_s = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)] / 8
    burst = max(512 * 1024, int(bytes_per_s * 1e-3))
    return ["tbf", "rate", rate, "burst", str(burst), "latency", "50ms"]


class Hosts:
    """``count`` network namespaces ("hosts" 1..count) on a bridge; a context manager that always tears
    down."""

    def __init__(
        self,
        count: int = 2,
        rate: Optional[str] = None,
        delay: Optional[str] = None,
        tag: Optional[int] = None,
    ):
        if not 1 <= count <= MAX_HOSTS:
            raise ValueError(f"hosts: 1 to {MAX_HOSTS}, got {count}")
        tag = os.getpid() if tag is None else tag
        self.count, self.tag = count, tag
        self.ns = {h: f"{PREFIX_NS}h{h}-{tag}" for h in self.numbers()}
        self.switch = f"{PREFIX_NS}sw-{tag}"
        self.subnet = f"{SUBNET_BASE}.{tag % 250}"
        self.rate, self.delay = rate, delay
        self._created: List[str] = []

    def numbers(self) -> range:
        """The hosts' numbers, 1..count."""
        return range(1, self.count + 1)

    # -- set up / tear down ---------------------------------------------------

    def __enter__(self) -> "Hosts":
        try:
            self.setup()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def ip(self, host: int) -> str:
        """The address of ``host``'s interface."""
        return f"{self.subnet}.{host}"

    def _veths(self, host: int) -> tuple:
        return f"{PREFIX_VETH}h{host}-{self.tag}", f"{PREFIX_VETH}s{host}-{self.tag}"

    def setup(self) -> None:
        """Create the switch and every host, their links, addresses and optional shaping."""
        for ns in (self.switch, *self.ns.values()):
            run(["ip", "netns", "add", ns])
            self._created.append(ns)
        run(in_ns(self.switch, "true"))  # `ip netns exec` must be able to remount /sys here
        run(["ip", "-n", self.switch, "link", "add", BRIDGE, "type", "bridge"])
        run(["ip", "-n", self.switch, "link", "set", BRIDGE, "up"])
        for host in self.numbers():
            ns, (host_end, switch_end) = self.ns[host], self._veths(host)
            run(["ip", "link", "add", host_end, "type", "veth", "peer", "name", switch_end])
            run(["ip", "link", "set", switch_end, "netns", self.switch])
            run(["ip", "link", "set", host_end, "netns", ns])
            run(["ip", "-n", ns, "link", "set", host_end, "name", IFNAME])
            run(["ip", "-n", self.switch, "link", "set", switch_end, "master", BRIDGE])
            run(["ip", "-n", self.switch, "link", "set", switch_end, "up"])
            run(["ip", "-n", ns, "addr", "add", f"{self.ip(host)}/24", "dev", IFNAME])
            run(["ip", "-n", ns, "link", "set", "lo", "up"])
            run(["ip", "-n", ns, "link", "set", IFNAME, "up"])
        if self.rate or self.delay:
            self._shape()
        log.info(
            "%d hosts %s..%s on a bridge in %s%s",
            self.count,
            self.ip(1),
            self.ip(self.count),
            self.switch,
            f", links shaped: rate {self.rate or '-'}, delay {self.delay or '-'}"
            if self.rate or self.delay
            else "",
        )

    def _shape(self) -> None:
        probe = run(
            ["tc", "-n", self.switch, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "0ms"],
            check=False,
        )
        netem = probe.returncode == 0
        if netem:
            run(["tc", "-n", self.switch, "qdisc", "del", "dev", "lo", "root"], check=False)
        else:
            log.warning("netem missing (%s): shaping with tbf, rate only", probe.stderr.strip())
        egress = shaping_qdisc(self.rate, self.delay, netem)
        towards = shaping_qdisc(self.rate, None, netem)
        for host in self.numbers():
            run(["tc", "-n", self.ns[host], "qdisc", "add", "dev", IFNAME, "root", *egress])
            if towards:
                run(["tc", "-n", self.switch, "qdisc", "add", "dev", self._veths(host)[1], "root", *towards])

    def teardown(self) -> None:
        """Delete the namespaces made here (their veths go with them) and any veth left in the root
        namespace."""
        for ns in reversed(self._created):
            r = run(["ip", "netns", "del", ns], check=False)
            if r.returncode != 0:
                log.warning("could not delete namespace %s: %s", ns, r.stderr.strip())
        self._created.clear()
        for host in self.numbers():  # setup may have stopped before moving both ends
            for dev in self._veths(host):
                if run(["ip", "link", "show", dev], check=False).returncode == 0:
                    run(["ip", "link", "del", dev], check=False)

    # -- use ------------------------------------------------------------------

    def cmd(self, host: int, *argv: str) -> List[str]:
        """``argv`` run inside ``host``'s namespace (:func:`in_ns`)."""
        return in_ns(self.ns[host], *argv)

    def counters(self, host: int) -> Dict[str, int]:
        """Bytes received and sent so far by ``host``'s interface: ``{"rx_bytes": .., "tx_bytes": ..}``."""
        r = run(["ip", "-n", self.ns[host], "-s", "-j", "link", "show", "dev", IFNAME])
        stats = json.loads(r.stdout)[0]["stats64"]
        return {"rx_bytes": int(stats["rx"]["bytes"]), "tx_bytes": int(stats["tx"]["bytes"])}

    @staticmethod
    def moved(before: Dict[str, int], after: Dict[str, int]) -> Dict[str, int]:
        """The counters' growth between two :meth:`counters` readings."""
        return {k: after[k] - before[k] for k in COUNTERS}

    def tcp_connections(self, host: int) -> int:
        """Established TCP connections of ``host``'s namespace to or from the other hosts."""
        r = run(
            [
                "ss",
                "-H",
                "-t",
                "-n",
                "-N",
                self.ns[host],
                "state",
                "established",
                "dst",
                f"{self.subnet}.0/24",
            ],
            check=False,
        )
        return len(r.stdout.splitlines()) if r.returncode == 0 else -1

    @staticmethod
    def sysfs_counter_paths() -> Dict[str, str]:
        """Where a process inside a host's namespace reads its interface's counters (sysfs)."""
        return {k: f"/sys/class/net/{IFNAME}/statistics/{k}" for k in COUNTERS}


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
    listing = run(["ip", "netns", "list"], check=False).stdout
    for ns, pid in re.findall(rf"^({PREFIX_NS}(?:h\d+|sw)-(\d+))", listing, flags=re.M):
        if not _pid_alive(int(pid)) and run(["ip", "netns", "del", ns], check=False).returncode == 0:
            removed.append(ns)
    links = run(["ip", "-o", "link", "show"], check=False).stdout
    for dev, pid in re.findall(rf"^\d+: ({PREFIX_VETH}[hs]\d+-(\d+))[@:]", links, flags=re.M):
        if not _pid_alive(int(pid)) and run(["ip", "link", "del", dev], check=False).returncode == 0:
            removed.append(dev)
    return removed


# `check`: a TCP sink in host 1 (prints the bytes it got) and a source of 16 MiB in the last host.
_SINK = (
    "import socket,sys; s=socket.create_server((sys.argv[1], 7000)); c=s.accept()[0]; n=0\n"
    "while (b := c.recv(1 << 20)): n += len(b)\nprint(n)"
)
_SOURCE = (
    "import socket,sys,time\nfor _ in range(100):\n"
    "  try: c=socket.create_connection((sys.argv[1], 7000)); break\n"
    "  except OSError: time.sleep(0.05)\nc.sendall(bytes(16 << 20)); c.close()"
)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m harness.netns", description=__doc__.splitlines()[0] + " Needs root."
    )
    p.add_argument(
        "command",
        nargs="?",
        default="check",
        choices=["check", "cleanup"],
        help="check (default): the hosts, 16 MiB over TCP from the last to host 1; cleanup: "
        "remove what a SIGKILLed run left",
    )
    p.add_argument(
        "options",
        nargs="*",
        metavar="KEY=VALUE",
        help="check: hosts=N (default 2), rate=R (e.g. 1gbit) and delay=D (e.g. 1ms) shape the links",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "cleanup":
        removed = cleanup_stale()
        log.info("removed %s", ", ".join(removed) if removed else "nothing")
        return 0
    opts = dict(o.split("=", 1) for o in args.options if "=" in o)
    if len(opts) != len(args.options) or set(opts) - {"hosts", "rate", "delay"}:
        p.error(f"check takes hosts=N, rate=R and delay=D, got {args.options}")
    try:
        return _check(int(opts.get("hosts", 2)), opts.get("rate"), opts.get("delay"))
    except (NetnsError, ValueError) as e:
        log.error("%s", e)
        return 1


def _check(count: int, rate: Optional[str], delay: Optional[str]) -> int:
    """`check`: 16 MiB over TCP from the last host to host 1, over links shaped by ``rate`` and ``delay``."""
    with Hosts(count, rate=rate, delay=delay) as hosts:
        last = hosts.count
        before, t0 = hosts.counters(last), time.monotonic()
        server = subprocess.Popen(
            hosts.cmd(1, sys.executable, "-c", _SINK, hosts.ip(1)), stdout=subprocess.PIPE, text=True
        )
        try:
            run(hosts.cmd(last, sys.executable, "-c", _SOURCE, hosts.ip(1)), timeout=60)
            got = server.communicate(timeout=30)[0].strip()
        finally:
            server.kill()
            server.wait()
        log.info(
            "%s bytes sent %s -> %s over TCP in %.2f s (processes' start included); "
            "host %d's interface moved %s",
            got,
            hosts.ip(last),
            hosts.ip(1),
            time.monotonic() - t0,
            last,
            hosts.moved(before, hosts.counters(last)),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
