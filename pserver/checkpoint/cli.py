"""``ps-checkpoint``: list the checkpoints under a directory, or export one for serving.

    ps-checkpoint list CKPT_DIR
    ps-checkpoint export CKPT_DIR OUT [--step N]

``export`` writes OUT/state_dict.pt (the dense parameters, a plain state_dict
for ``load_state_dict(strict=False)``) and OUT/tables/<table>.{ids,rows}.npy
(each distributed table's stored rows), from the latest complete checkpoint
or the one at ``--step``, whatever the number of pservers that wrote it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

from .layout import export, find_saved, list_parts


def _list(root: str) -> int:
    parts = list_parts(root)
    if not parts:
        print(f"{root}: no checkpoints")
        return 1
    latest = find_saved(root, sync_mode=True)
    print(f"{'STEP':>12}  {'PSERVERS':>8}  {'PARTS':>5}  COMPLETE  WRITTEN")
    for (step, n), have in sorted(parts.items()):
        written = max(m["written_at"] for _, m in have.values())
        when = datetime.datetime.fromtimestamp(written).isoformat(sep=" ", timespec="seconds")
        mark = "yes" if len(have) == n else "no"
        if latest is not None and latest.step == step and latest.n_shards == n:
            mark += " (latest)"
        print(f"{step:>12}  {n:>8}  {len(have):>5}  {mark:<8}  {when}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="ps-checkpoint", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_list = sub.add_parser("list", help="the checkpoints under a directory")
    p_list.add_argument("root")
    p_export = sub.add_parser("export", help="a checkpoint as a state_dict and table files")
    p_export.add_argument("root")
    p_export.add_argument("out")
    p_export.add_argument("--step", type=int, help="the checkpoint's step (default: the latest complete)")
    p_export.add_argument(
        "--async_parts",
        action="store_true",
        help="take each pserver's latest part (checkpoints of an async job)",
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            return _list(args.root)
        summary = export(args.root, args.out, args.step, sync_mode=not args.async_parts)
    except (OSError, ValueError) as e:
        print(f"ps-checkpoint: error: {e}", file=sys.stderr)
        return 2
    print(f"checkpoint at step {summary['step']} ({summary['pservers']} pservers) -> {args.out}")
    print(f"  {summary['state_dict']}: {len(summary['params'])} dense parameters")
    for table, info in summary["tables"].items():
        print(
            f"  {table}: {info['rows']:,} rows of dim {info['dim']} -> "
            f"{os.path.join(args.out, 'tables', info['ids_file'])}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
