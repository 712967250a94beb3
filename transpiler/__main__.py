"""``python -m transpiler show FILE.py:FUNC --pservers ... [config flags]``

Prints, for the program FUNC() returns, every block (param, rows, shape,
bytes) and the pserver that owns it, plus a per-pserver load summary, so the
effect of ``slice_var_up``, ``split_method`` and ``min_block_size`` is visible
before a job starts.

``python -m transpiler config-reference`` prints the configuration reference
(docs/configuration.md), generated from the config dataclasses.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

from .cli import add_transpile_arguments, config_from_args, config_reference, load_program
from .transpiler import DistributeTranspiler


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m transpiler")
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="print the block layout of a program")
    show.add_argument("program", help="FILE.py:FUNC or module:FUNC returning a transpiler.Program")
    show.add_argument(
        "--pservers",
        default="127.0.0.1:6170,127.0.0.1:6171",
        help="comma-separated pserver endpoints (default: two on loopback)",
    )
    show.add_argument("--trainers", type=int, default=2, help="number of trainers (default 2)")
    add_transpile_arguments(show)
    sub.add_parser("config-reference", help="print the configuration reference (docs/configuration.md)")
    args = parser.parse_args(argv)
    if args.command == "config-reference":
        sys.stdout.write(config_reference())
        return 0
    try:
        program = load_program(args.program)
        t = DistributeTranspiler(config_from_args(args))
        t.transpile(
            0, program=program, pservers=args.pservers, trainers=args.trainers, sync_mode=args.sync_mode
        )
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    trainer_program = t.get_trainer_program()
    print(trainer_program)
    load = Counter()
    for b in trainer_program.blocks:
        load[b.endpoint] += b.nbytes
    if not trainer_program.pservers:  # collective mode: nothing is placed on pservers
        return 0
    print("\nper pserver:")
    for ep in trainer_program.pservers:
        n = sum(1 for b in trainer_program.blocks if b.endpoint == ep)
        print(f"  {ep}  {n} blocks  {load[ep]:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
