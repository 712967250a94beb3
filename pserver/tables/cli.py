"""``python -m pserver.tables.cli ROOT OUT``: export every table saved under ROOT as plain files.

ROOT is the directory given to ``Trainer.save_tables`` (shards of any number of
pservers); OUT receives ``<table>.ids.npy`` (int64), ``<table>.rows.npy``
(``(n, dim)``) and ``<table>.json`` per table, readable with numpy alone.
"""

from __future__ import annotations

import argparse
import os
import sys

from .plain_files import export_tables


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pserver.tables.cli",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("root", help="the directory given to save_tables")
    parser.add_argument("out", help="where to write <table>.ids.npy, <table>.rows.npy, <table>.json")
    args = parser.parse_args(argv)
    try:
        for table, info in export_tables(args.root, args.out).items():
            print(
                f"{table}: {info['rows']:,} rows of dim {info['dim']} -> "
                f"{os.path.join(args.out, info['ids_file'])}, {info['rows_file']}"
            )
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
