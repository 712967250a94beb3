"""The container image's entry point: log this pod's role, and let a pserver start only once its own
name resolves to this pod; then run the command (the image's CMD, or a manifest's ``args``).

    python /app/deploy/entrypoint.py python /app/examples/train_ctr.py [args...]

A pserver binds exactly its endpoint's host (``ps-pserver-0.ps-pserver``, or a TFJob's
``<job>-ps-0.<namespace>.svc``), and that DNS record appears only after the pod has an
address (the headless Service publishes not-ready pods) or, under the TFJob operator, once it
runs. Binding before then fails and costs a container restart, so a pserver waits here until
the name resolves to ``POD_IP`` (to any address when ``POD_IP`` is unset), at most
``PS_RESOLVE_TIMEOUT`` seconds (default 300). Trainers, IP endpoints and local runs start at once.
A malformed role environment exits 2 with the variable's name, before the script starts.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import sys
import time
from typing import Callable, List, Mapping, Optional, Sequence

from transpiler import RoleEnv

log = logging.getLogger("entrypoint")
Resolver = Callable[[str], List[str]]


def name_to_wait_for(role: Optional[RoleEnv]) -> Optional[str]:
    """The host a pserver must see resolve before it binds; None for every other role and IP endpoints."""
    if role is None or not role.is_pserver or not role.current_endpoint:
        return None
    host = role.current_endpoint.rpartition(":")[0].strip("[]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return host
    return None


def resolves_here(addresses: Sequence[str], pod_ip: Optional[str]) -> bool:
    """True once the name gives this pod's address (any address when the pod's is unknown)."""
    return pod_ip in addresses if pod_ip else bool(addresses)


def resolve(host: str) -> List[str]:
    """Every address ``host`` resolves to now ([] while it does not)."""
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)})
    except (socket.gaierror, UnicodeError):
        return []


def wait_for_name(
    host: str,
    pod_ip: Optional[str],
    timeout: float,
    resolver: Optional[Resolver] = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    every: float = 1.0,
) -> List[str]:
    """Resolve ``host`` every ``every`` s until it gives ``pod_ip``: its addresses; TimeoutError after
    ``timeout`` s."""
    resolver = resolver or resolve
    deadline = clock() + timeout
    while True:
        addresses = resolver(host)
        if resolves_here(addresses, pod_ip):
            return addresses
        if clock() >= deadline:
            raise TimeoutError(
                f"{host} did not resolve to {pod_ip or 'an address'} within {timeout:g} s "
                f"(PS_RESOLVE_TIMEOUT; last answer: {addresses or 'no such name'}); is the "
                f"pserver Service headless with publishNotReadyAddresses, and its name in "
                f"PS_PSERVER_SERVICE?"
            )
        sleep(every)


def main(argv: Optional[Sequence[str]] = None, environ: Mapping[str, str] = os.environ) -> int:
    command = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not command:
        print("usage: entrypoint.py COMMAND [ARG...]", file=sys.stderr)
        return 2
    try:
        role = RoleEnv.from_env(environ)
        timeout = _seconds(environ, "PS_RESOLVE_TIMEOUT", 300.0)
    except ValueError as e:
        print(f"entrypoint: error: {e}", file=sys.stderr)
        return 2
    if role is None:
        log.info("no role in the environment: a local run")
    elif role.is_pserver:
        log.info(
            "pserver %d of %d at %s (from %s), %d trainers",
            role.pservers.index(role.current_endpoint),
            len(role.pservers),
            role.current_endpoint,
            role.source,
            role.trainers,
        )
    else:
        log.info(
            "trainer %d of %d (from %s), %s",
            role.trainer_id,
            role.trainers,
            role.source,
            f"pservers {role.pserver_list}" if role.pservers else "collective",
        )
    host = name_to_wait_for(role)
    if host is not None:
        try:
            addresses = wait_for_name(host, environ.get("POD_IP") or None, timeout)
        except TimeoutError as e:
            print(f"entrypoint: error: {e}", file=sys.stderr)
            return 1
        log.info("%s resolves to %s", host, ", ".join(addresses))
    sys.stdout.flush()
    try:
        os.execvp(command[0], command)
    except OSError as e:
        print(f"entrypoint: error: cannot run {command[0]}: {e}", file=sys.stderr)
        return 127
    return 0  # not reached: exec replaced this process


def _seconds(environ: Mapping[str, str], name: str, default: float) -> float:
    text = environ.get(name, "").strip()
    try:
        value = float(text) if text else default
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"{name} must be a number of seconds >= 0, got {text!r}")
    return value


if __name__ == "__main__":
    sys.exit(main())
