"""Routing table ids to pservers: how many rows a change of pserver count moves, how even the shards are,
and what a route costs, for the candidate schemes.

    python -m benchmarks.bench_routing [--ids 2000000] [--max_pservers 16] [--runs 5]

For ``--ids`` distinct ids (arbitrary-looking int64) and every ``P`` from 1 to ``--max_pservers - 1``:
the fraction of ids whose owner differs between ``P`` and ``P + 1`` pservers (the ideal is ``1 / (P + 1)``:
only the new pserver's share moves) and the largest shard over the mean at ``P + 1``; then the median over
``--runs`` of nanoseconds per id to route job S's 6,300 distinct ids of a step (numpy, one process).

Schemes: ``modulo`` (``stable_hash % P``, routing version 1), ``slots-S`` (the low bits of the hash pick
one of ``S`` slots, whose owner is ``jump_hash(slot, P)``: version 2 with ``S`` = 16,384), ``jump`` (jump
consistent hash of each id's hash), ``ring-V`` (a consistent-hash ring with ``V`` virtual points per
pserver) and ``rendezvous`` (highest random weight). Writes ``results/routing-<date>.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable, Dict

import numpy as np

from benchmarks.common.machine import cpu_model
from benchmarks.common.paths import dated_result
from transpiler.layout.routing import jump_hash
from transpiler.placement import stable_hash_ids

_SCRAMBLE = np.uint64(0x9E3779B97F4A7C15)
STEP_IDS = 6_300  # job S: distinct ids a trainer routes per step


def _ids(n: int, offset: int = 0) -> np.ndarray:
    with np.errstate(over="ignore"):
        return (np.arange(offset, offset + n, dtype=np.uint64) * _SCRAMBLE).view(np.int64)


def _slots(bits: int) -> Callable[[np.ndarray, int], np.ndarray]:
    mask = np.uint64((1 << bits) - 1)
    tables: Dict[int, np.ndarray] = {}

    def route(ids, p):
        if p not in tables:
            tables[p] = jump_hash(np.arange(1 << bits, dtype=np.uint64), p).astype(np.int32)
        return tables[p][(stable_hash_ids(ids) & mask).astype(np.int64)]

    return route


def _ring(points: int) -> Callable[[np.ndarray, int], np.ndarray]:
    rings: Dict[int, tuple] = {}

    def route(ids, p):
        if p not in rings:
            owner = np.repeat(np.arange(p), points)
            where = stable_hash_ids(owner.astype(np.int64) * 1_000_003 + np.tile(np.arange(points), p))
            order = np.argsort(where)
            rings[p] = (where[order], owner[order])
        where, owner = rings[p]
        at = np.searchsorted(where, stable_hash_ids(ids)) % where.size
        return owner[at]

    return route


def _rendezvous(ids, p):
    h = stable_hash_ids(ids)
    weights = np.stack(
        [
            stable_hash_ids((h ^ np.uint64((k * 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF)).view(np.int64))
            for k in range(p)
        ]
    )
    return np.argmax(weights, axis=0)


SCHEMES: Dict[str, Callable[[np.ndarray, int], np.ndarray]] = {
    "modulo": lambda ids, p: (stable_hash_ids(ids) % np.uint64(p)).astype(np.int64),
    "slots-1024": _slots(10),
    "slots-16384": _slots(14),
    "slots-65536": _slots(16),
    "jump": lambda ids, p: jump_hash(stable_hash_ids(ids), p),
    "ring-64": _ring(64),
    "ring-512": _ring(512),
    "rendezvous": _rendezvous,
}


def measure(scheme: str, ids: np.ndarray, max_pservers: int, runs: int) -> dict:
    """Moves and balance for every P -> P + 1 up to ``max_pservers``, and the route's cost per id."""
    route = SCHEMES[scheme]
    moves, balance = {}, {}
    before = route(ids, 1)
    for p in range(1, max_pservers):
        after = route(ids, p + 1)
        moves[p] = float(np.mean(before != after))
        counts = np.bincount(after, minlength=p + 1)
        balance[p + 1] = float(counts.max() / counts.mean())
        before = after
    step = _ids(STEP_IDS, offset=ids.size)
    route(step, 8)  # tables built before timing
    ns = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(20):
            route(step, 8)
        ns.append((time.perf_counter() - t0) / 20 / STEP_IDS * 1e9)
    return {"moved": moves, "max_over_mean": balance, "ns_per_id_p8": statistics.median(ns)}


def main(argv=None) -> None:
    """Measure every scheme; print a markdown table; write the JSON result."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ids", type=int, default=2_000_000)
    ap.add_argument("--max_pservers", type=int, default=16)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args(argv)
    ids = _ids(args.ids)
    results = {name: measure(name, ids, args.max_pservers, args.runs) for name in SCHEMES}
    shown = [p for p in (1, 2, 3, 4, 7, 15) if p < args.max_pservers]
    print(f"{args.ids:,} ids; moved fraction P -> P+1 (ideal 1/(P+1)); max/mean shard at P+1; {cpu_model()}")
    print("| scheme | " + " | ".join(f"{p}->{p + 1} moved" for p in shown) + " | worst max/mean | ns/id |")
    print("|---|" + "---|" * (len(shown) + 2))
    print("| ideal | " + " | ".join(f"{1 / (p + 1):.3f}" for p in shown) + " | 1.000 | |")
    for name, r in results.items():
        moved = " | ".join(f"{r['moved'][p]:.3f}" for p in shown)
        worst = max(r["max_over_mean"].values())
        print(f"| {name} | {moved} | {worst:.3f} | {r['ns_per_id_p8']:.1f} |")
    out = dated_result("routing")
    with open(out, "w") as f:
        json.dump({"ids": args.ids, "cpu": cpu_model(), "schemes": results}, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
