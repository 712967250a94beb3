"""``ps-stat``: one line per pserver of a running job: layout epoch, step, trainers, sizes, traffic, dropped
pushes (backup trainers), heartbeats, checkpoint;
then one line per distributed table and pserver: rows in memory and on disk, and the lifecycle's
counts (admitted, refused, evicted, spilled, promoted).

    ps-stat 127.0.0.1:6170,127.0.0.1:6171          # or PADDLE_PSERVERS_IP_PORT_LIST
    ps-stat --json --interval 0 127.0.0.1:6170     # one JSON object per pserver

Calls each pserver's Stats RPC with the job's access settings (PS_AUTH_TOKEN /
PS_AUTH_TOKEN_FILE, PS_TLS_*), all pservers in parallel. pushes/s is measured
over --interval seconds (two samples); with --interval 0 it is the average
since the pserver started. Exit status: 0 when every pserver answered, 1 when
one did not (its row says why), 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent import futures
from typing import Dict, List, Optional, Sequence, Tuple, Union

import grpc
from google.protobuf import descriptor, json_format

from psproto import ps_pb2, ps_pb2_grpc
from psproto.security import Security
from transpiler.roles.role_env import parse_endpoints

HEADERS = (
    "ENDPOINT",
    "MODE",
    "LAYOUT",
    "STEP",
    "TRAINERS",
    "DROPPED",
    "BLOCKS",
    "BLOCK BYTES",
    "TABLE ROWS",
    "BYTES IN",
    "BYTES OUT",
    "PUSHES/S",
    "DROPPED PUSHES",
    "HEARTBEATS",
    "CHECKPOINT",
)
_INT64 = {
    descriptor.FieldDescriptor.TYPE_INT64,
    descriptor.FieldDescriptor.TYPE_UINT64,
    descriptor.FieldDescriptor.TYPE_SINT64,
    descriptor.FieldDescriptor.TYPE_FIXED64,
    descriptor.FieldDescriptor.TYPE_SFIXED64,
}

TABLE_HEADERS = (
    "TABLE",
    "ENDPOINT",
    "ROWS",
    "ON DISK",
    "DISK BYTES",
    "ADMITTED",
    "REFUSED",
    "EVICTED",
    "SPILLED",
    "PROMOTED",
)
REPLICA_HEADERS = (
    "ENDPOINT",
    "ROLE",
    "EPOCH",
    "PRIMARY",
    "BACKUP",
    "IN SYNC",
    "LAG",
    "REPLICATED",
    "DIGEST MISMATCHES",
)
Sample = Union[ps_pb2.StatsReply, str]  # a reply, or the error that came instead


def human_bytes(n: float) -> str:
    """``n`` bytes as a short human-readable size: ``512 B``, ``1.5 KiB``, ``3.0 GiB``."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024.0
        if abs(n) < 1024 or unit == "TiB":
            break
    return f"{n:.1f} {unit}"


def _error_text(e: grpc.RpcError) -> str:
    code = e.code() if hasattr(e, "code") else None
    details = (e.details() if hasattr(e, "details") else None) or str(e)
    return f"{code.name if code else 'ERROR'}: {details}"


def sample(
    stubs: Dict[str, ps_pb2_grpc.ParameterServerStub], timeout: float, pool: futures.Executor
) -> Dict[str, Sample]:
    """One Stats reply (or error text) per endpoint, all endpoints asked in parallel."""

    def one(stub) -> Sample:
        try:
            return stub.Stats(ps_pb2.StatsRequest(), timeout=timeout)
        except grpc.RpcError as e:
            return _error_text(e)

    jobs = {ep: pool.submit(one, stub) for ep, stub in stubs.items()}
    return {ep: job.result() for ep, job in jobs.items()}


def pushes_per_s(
    first: ps_pb2.StatsReply, second: Optional[ps_pb2.StatsReply], interval: float
) -> Optional[float]:
    """Push rate: between two samples ``interval`` s apart, else the mean since start (None: unknown)."""
    if second is not None and interval > 0:
        if second.incarnation != first.incarnation:
            return None  # the pserver restarted between samples: the difference means nothing
        return max(0, second.pushes - first.pushes) / interval
    if first.uptime_s > 0:
        return first.pushes / first.uptime_s
    return None


def _ids(ids: Sequence[int]) -> str:
    return ",".join(str(i) for i in ids) if ids else "-"


def _checkpoint(r: ps_pb2.StatsReply) -> str:
    if r.checkpoint_step < 0 or (r.checkpoint_step == 0 and not r.checkpoint_path):
        return "-"  # 0 without a path: a pserver that does not report checkpoints yet
    return f"step {r.checkpoint_step}, {r.checkpoint_age_s:.0f}s ago"


def row(endpoint: str, r: ps_pb2.StatsReply, rate: Optional[float]) -> Tuple[str, ...]:
    """The table row of one pserver's reply."""
    return (
        endpoint,
        "sync" if r.sync_mode else "async",
        f"epoch {r.layout_epoch}"
        + (f", {r.layout_parts_moved}/{r.layout_parts_to_move} moved" if r.layout_change else ""),
        str(r.step),
        _ids(r.trainers_alive),
        _ids(r.trainers_dropped),
        str(r.blocks),
        human_bytes(r.block_bytes),
        f"{r.table_rows:,}",
        human_bytes(r.bytes_in),
        human_bytes(r.bytes_out),
        "-" if rate is None else f"{rate:.1f}",
        f"{r.dropped_pushes:,}",
        f"{r.heartbeats:,}",
        _checkpoint(r),
    )


def as_json(endpoint: str, r: Sample, rate: Optional[float]) -> dict:
    """One pserver as a JSON-ready dict: every StatsReply field plus ``pushes_per_s``, or its error."""
    if isinstance(r, str):
        return {"endpoint": endpoint, "error": r}
    d = json_format.MessageToDict(
        r, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    # Proto3 JSON writes 64-bit integers as strings; a monitoring script wants numbers.
    for f in r.DESCRIPTOR.fields:
        if f.type in _INT64 and f.name in d:
            v = d[f.name]
            d[f.name] = [int(x) for x in v] if isinstance(v, list) else int(v)
    for t in d.get("tables", []):
        for f in ps_pb2.TableStats.DESCRIPTOR.fields:
            if f.type in _INT64 and f.name in t:
                t[f.name] = int(t[f.name])
    if r.HasField("replica"):
        for f in ps_pb2.ReplicaStats.DESCRIPTOR.fields:
            if f.type in _INT64 and f.name in d["replica"]:
                d["replica"][f.name] = int(d["replica"][f.name])
    else:
        d.pop("replica", None)
    d["endpoint"] = endpoint  # the address asked, even if the pserver names itself otherwise
    d["pushes_per_s"] = rate
    return d


def table_rows(endpoint: str, r: ps_pb2.StatsReply) -> List[Tuple[str, ...]]:
    """The per-table rows of one pserver's reply."""
    return [
        (
            t.table,
            endpoint,
            f"{t.rows:,}",
            f"{t.disk_rows:,}",
            human_bytes(t.disk_bytes),
            f"{t.admitted:,}",
            f"{t.refused:,}",
            f"{t.evicted:,}",
            f"{t.spilled:,}",
            f"{t.promoted:,}",
        )
        for t in r.tables
    ]


def replica_row(endpoint: str, r: ps_pb2.StatsReply) -> List[Tuple[str, ...]]:
    """The hot-standby row of one pserver process's reply ([] without replicas)."""
    if not r.HasField("replica"):
        return []
    p = r.replica
    return [
        (
            endpoint,
            p.role,
            str(p.epoch),
            p.primary or "-",
            p.backup or "-",
            "yes" if p.backup_in_sync else "no",
            str(p.lag),
            f"{p.replicated:,}",
            str(p.digest_mismatches),
        )
    ]


def format_table(rows: List[Tuple[str, ...]], headers: Tuple[str, ...] = HEADERS) -> str:
    """Left-aligned columns under ``headers``; an error row's message runs past the columns."""
    full = [r for r in rows if len(r) == len(headers)]
    widths = [max(len(r[c]) for r in [headers, *full]) for c in range(len(headers))]
    lines = []
    for r in [headers, *rows]:
        lines.append("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    return "\n".join(lines)


def _positive(kind: str, allow_zero: bool):
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{kind} must be a number of seconds, got {text!r}") from None
        if v < 0 or (v == 0 and not allow_zero) or v != v or v == float("inf"):
            raise argparse.ArgumentTypeError(f"{kind} must be {'>= 0' if allow_zero else '> 0'}, got {text}")
        return v

    return parse


def build_parser() -> argparse.ArgumentParser:
    """The ``ps-stat`` argument parser."""
    p = argparse.ArgumentParser(
        prog="ps-stat", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "endpoints",
        nargs="?",
        metavar="ENDPOINTS",
        help="comma-separated pserver endpoints (default: PADDLE_PSERVERS_IP_PORT_LIST)",
    )
    p.add_argument(
        "--interval",
        type=_positive("--interval", True),
        default=1.0,
        metavar="S",
        help="measure pushes/s over S seconds (default 1); 0: average since start",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object per pserver per line")
    p.add_argument(
        "--timeout",
        type=_positive("--timeout", False),
        default=5.0,
        metavar="S",
        help="deadline of each Stats call (default 5)",
    )
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``ps-stat``; returns 0 (all answered), 1 (some did not) or 2 (bad input)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse has printed the message; return rather than exit, for callers
        return e.code if isinstance(e.code, int) else 2
    text = args.endpoints or os.environ.get("PADDLE_PSERVERS_IP_PORT_LIST", "")
    try:
        if not text.strip():
            raise ValueError("no endpoints: give ENDPOINTS or set PADDLE_PSERVERS_IP_PORT_LIST")
        endpoints = parse_endpoints(text)
        if not args.endpoints and os.environ.get("PS_REPLICA_ENDPOINTS", "").strip():
            endpoints += parse_endpoints(os.environ["PS_REPLICA_ENDPOINTS"])  # hot standby: every process
        security = Security.from_env()
    except ValueError as e:
        print(f"ps-stat: error: {e}", file=sys.stderr)
        return 2

    channels = {ep: security.channel(ep) for ep in endpoints}
    stubs = {ep: ps_pb2_grpc.ParameterServerStub(ch) for ep, ch in channels.items()}
    try:
        with futures.ThreadPoolExecutor(max_workers=min(32, len(endpoints))) as pool:
            first = sample(stubs, args.timeout, pool)
            second: Dict[str, Sample] = {}
            live = {ep: stubs[ep] for ep, r in first.items() if not isinstance(r, str)}
            if args.interval > 0 and live:
                time.sleep(args.interval)
                second = sample(live, args.timeout, pool)
    finally:
        for ch in channels.values():
            ch.close()

    failed = False
    rows, objects, tables, replicas = [], [], [], []
    for ep in endpoints:
        r, rate = first[ep], None
        later = second.get(ep)
        if isinstance(later, str):
            r = later  # it answered once and then failed: report the failure
        if isinstance(r, str):
            failed = True
            rows.append((ep, r))
        else:
            rate = pushes_per_s(r, later, args.interval)
            if later is not None:
                r = later  # show the newer numbers
            rows.append(row(ep, r, rate))
            tables += table_rows(ep, r)
            replicas += replica_row(ep, r)
        objects.append(as_json(ep, r, rate))
    if args.json:
        for obj in objects:
            print(json.dumps(obj, sort_keys=True))
    else:
        print(format_table(rows))
        if tables:
            print()
            print(format_table(sorted(tables), TABLE_HEADERS))
        if replicas:
            print()
            print(format_table(replicas, REPLICA_HEADERS))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
