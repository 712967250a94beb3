"""``ps-reshard``: ask a running job to change its pserver count, and wait until it has.

    ps-reshard --checkpoint_dir /shared/ckpt --pservers 10.0.0.1:6170,10.0.0.2:6170,10.0.0.3:6170
    ps-reshard --checkpoint_dir /shared/ckpt --pservers A,B,C --replicas D,E,F     # hot standby: the backups

The job's pservers carry the change out (:mod:`pserver.layout.switch`): at a sync step two ahead they
write the checkpoint of that step, and the pservers of the new list go on from it, re-sharded, while the
trainers stay up. Start the new pservers (with the new list) before or after asking; they wait for the
change that adds them. Exit status: 0 once the job runs the new layout; 1 if the change was rolled back or
did not finish in time (the job goes on in its current layout); 2 if it was refused (nothing changed).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, Optional

from transpiler.layout.change_checks import LayoutChangeRefused
from transpiler.layout.record import LayoutRecord

from . import phases
from .stores import FileLayoutStore, LayoutStore, update

POLL_S = 0.1


class ChangeNotMade(RuntimeError):
    """The change asked was rolled back, or not made in time; the job runs its current layout."""


def ask_change(
    store: LayoutStore,
    pservers,
    timeout: float,
    on_phase: Callable[[str], None] = lambda p: None,
    replicas=(),
):
    """Ask the job whose record ``store`` keeps to run on ``pservers`` (with hot standby, backed up by
    ``replicas``, one each, in their order) and wait up to ``timeout`` s for the change to commit; the
    committed record. :class:`LayoutChangeRefused` (nothing changed) for a bad list,
    a change in progress or a job without a record; :class:`ChangeNotMade` if it was rolled back or did not
    commit in time (one not yet begun is then withdrawn)."""
    record = store.read()
    if record is None:
        raise LayoutChangeRefused(
            "no layout record: no job with this checkpoint_dir has started (its pservers write the record)"
        )
    asked = update(store, lambda r: phases.ask(r, pservers, replicas, now=time.time()), record)
    epoch, deadline, phase = asked.change.epoch, time.monotonic() + timeout, None
    while True:
        now = store.read()
        if now.epoch >= epoch:
            return now
        change = now.change
        if change is None or change.epoch != epoch:
            raise ChangeNotMade(f"the change to layout epoch {epoch} was rolled back: {now.rolled_back}")
        if change.phase != phase:
            phase = change.phase
            on_phase(
                phase
                + (f" at the end of step {change.switch_step}" if change.switch_step is not None else "")
            )
        if time.monotonic() > deadline:
            if _withdraw(store, epoch):
                raise ChangeNotMade(f"the job made no step within {timeout:.0f}s; the change was withdrawn")
            deadline = time.monotonic() + timeout  # begun: the pservers commit it or roll it back themselves
            continue
        time.sleep(POLL_S)


def _withdraw(store: LayoutStore, epoch: int) -> bool:
    """Roll back the change to ``epoch`` if it is still only asked; whether it was."""

    def withdraw(record: LayoutRecord) -> LayoutRecord:
        if record.change is None or record.change.epoch != epoch or record.change.phase != "asked":
            raise LayoutChangeRefused("begun")
        return phases.rolled_back(phases.roll_back(record, "withdrawn: the job made no step in time"))

    try:
        update(store, withdraw, store.read())
        return True
    except LayoutChangeRefused:
        return False


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ps-reshard", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--checkpoint_dir", required=True, help="the job's checkpoint_dir (its layout record)"
    )
    parser.add_argument("--pservers", required=True, help="the job's new pserver endpoints, comma-separated")
    parser.add_argument(
        "--replicas",
        default="",
        help="hot standby: the new pservers' backups, comma-separated, one per pserver in their order",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the change (600)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        record = ask_change(
            FileLayoutStore(args.checkpoint_dir),
            args.pservers.split(","),
            args.timeout,
            lambda phase: print(f"ps-reshard: {phase}", flush=True),
            [ep for ep in args.replicas.split(",") if ep.strip()],
        )
    except (LayoutChangeRefused, ValueError) as e:
        print(f"ps-reshard: refused: {e}", file=sys.stderr)
        return 2
    except (ChangeNotMade, TimeoutError) as e:
        print(f"ps-reshard: {e}", file=sys.stderr)
        return 1
    since = f"step {record.since_step}" if record.since_step >= 0 else "each trainer's switch step (async)"
    print(
        f"ps-reshard: the job runs layout epoch {record.epoch} on {len(record.pservers)} pservers from "
        f"{since} ({time.monotonic() - started:.1f}s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
