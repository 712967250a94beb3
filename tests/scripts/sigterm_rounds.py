"""One pserver process stopped by SIGTERM again and again: ``ps-server``'s main, run ``--rounds`` times.

Each round runs :func:`pserver.cli.main` on a free port of 127.0.0.1 (one trainer, the
``odd_program`` model): a fresh :class:`~pserver.server.ParameterServer`, its event loop and
gRPC's asyncio server, stopped as ``ps-server`` stops at the end of a job. Once the round's
SIGTERM handler is in place (``serve()`` installs it after the server started, and puts the
default back when it returns) the script prints ``serving <round>`` on stdout: a SIGTERM sent
then reaches the pserver, never Python's default action. After the round it prints ``stopped
<round> <status>``. The process exits with the first nonzero status, else 0; one that runs
past ``--deadline`` seconds exits 4, so a broken stop cannot leave it running.

The pserver's log goes to stderr, as ``ps-server``'s does: what a test reads for tracebacks.
"""

import argparse
import os
import signal
import sys
import threading
import time

from harness.ports import free_ports
from pserver.cli import main

PROGRAM = "harness/models.py:odd_program"  # run from the repository's root, on its PYTHONPATH


def announce_when_handled(round_: int, deadline: float) -> None:
    """Print ``serving <round>`` once SIGTERM has a handler of the pserver's (checked every 10 ms)."""
    while signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        if time.monotonic() > deadline:
            return
        time.sleep(0.01)
    print(f"serving {round_}", flush=True)


def watchdog(seconds: float) -> None:
    """Exit 4 once ``seconds`` have passed, whatever the rounds are doing."""
    time.sleep(seconds)
    print(f"deadline of {seconds}s passed", file=sys.stderr, flush=True)
    os._exit(4)


def run() -> int:
    """Run the rounds; the first nonzero status of ps-server's main, else 0."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--deadline", type=float, default=120.0)
    args = parser.parse_args()
    threading.Thread(target=watchdog, args=(args.deadline,), daemon=True).start()
    deadline = time.monotonic() + args.deadline
    for round_ in range(args.rounds):
        endpoint = f"127.0.0.1:{free_ports(1)[0]}"
        threading.Thread(target=announce_when_handled, args=(round_, deadline), daemon=True).start()
        status = main(
            [
                "--program",
                PROGRAM,
                "--endpoint",
                endpoint,
                "--pservers",
                endpoint,
                "--trainers",
                "1",
            ]
        )
        print(f"stopped {round_} {status}", flush=True)
        if status:
            return status
    return 0


if __name__ == "__main__":
    sys.exit(run())
