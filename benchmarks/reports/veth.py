"""bench_veth's configurations, and how their runs' figures are checked and tabled.

:data:`CONFIGS` names what ``python -m benchmarks.bench_veth`` compares (its docstring describes
each); :func:`crossing_problems` is the check that a run's traffic took the link its configuration
names; :func:`table` is the markdown table of the runs' medians, with its legend.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from benchmarks.reports.dense import med

# Shares of the payload per step that must (veth over TCP) / must not (loopback) cross the veth.
CROSSED_MIN, LOOPBACK_MAX = 0.90, 0.01


@dataclass(frozen=True)
class Config:
    """One configuration: ``system`` (ps, rpc, ddp) on ``link`` (veth: two hosts; lo: all in host 1).

    ``tcp_only`` restricts TensorPipe to TCP (transport uv, channels from ``--tp-channels``); otherwise it
    uses its defaults. ``wire``: the PS trainers push gradients in this dtype (``grad_wire_dtype``).
    ``shared``: the PS trainers' ``shared_memory``; ``lanes``: their ``push_lanes``. Only a ``tcp_only``
    veth configuration must move its payload across the veth (a PS one with ``shared`` is not).
    """

    system: str
    link: str
    tcp_only: bool = True
    what: str = ""
    wire: Optional[str] = None
    shared: bool = True
    lanes: int = 1  # the PS trainers' push_lanes


CONFIGS: Dict[str, Config] = {
    "ps-veth": Config(
        "ps",
        "veth",
        shared=False,
        what="this product, sync, 2 ps (host 1) x 2 trainers (host 2), shared memory off",
    ),
    "ps-veth-bf16": Config(
        "ps",
        "veth",
        wire="bfloat16",
        shared=False,
        what="this product as ps-veth, gradients pushed in bfloat16 (grad_wire_dtype)",
    ),
    "ps-veth-lanes2": Config(
        "ps",
        "veth",
        shared=False,
        lanes=2,
        what="this product as ps-veth, each push-pull split across 2 connections (push_lanes)",
    ),
    "ps-veth-lanes4": Config(
        "ps",
        "veth",
        shared=False,
        lanes=4,
        what="this product as ps-veth, each push-pull split across 4 connections (push_lanes)",
    ),
    "rpc-veth": Config(
        "rpc", "veth", what="torch rpc PS, 2 ps (host 1) x 2 trainers (host 2), TensorPipe TCP only"
    ),
    "ddp-veth": Config("ddp", "veth", what="DDP / gloo, rank 0 in host 1, rank 1 in host 2"),
    "rpc-veth-cma": Config(
        "rpc",
        "veth",
        tcp_only=False,
        what="torch rpc PS across the veth, TensorPipe defaults (cma: same-host shortcut)",
    ),
    "ps-veth-shm": Config(
        "ps",
        "veth",
        tcp_only=False,
        what="this product across the veth, shared memory on (the same-host shortcut)",
    ),
    "ps-lo": Config(
        "ps", "lo", what="this product, sync, 2 ps x 2 trainers, all on 127.0.0.1 (shared memory)"
    ),
    "ps-lo-grpc": Config(
        "ps", "lo", shared=False, what="this product on 127.0.0.1, shared memory off: every byte through gRPC"
    ),
    "rpc-lo": Config(
        "rpc",
        "lo",
        tcp_only=False,
        what="torch rpc PS on one host, TensorPipe defaults (shm + cma), as torch_peers.py",
    ),
    "rpc-lo-tcp": Config("rpc", "lo", what="torch rpc PS on 127.0.0.1, TensorPipe TCP only"),
    "ddp-lo": Config("ddp", "lo", what="DDP / gloo, 2 ranks on 127.0.0.1"),
}


def crossing_problems(rows: List[dict]) -> List[str]:
    """Runs whose veth traffic contradicts their configuration: TCP over the veth below 90% of the payload,
    or loopback runs that moved more than 1% of it through the veth."""
    bad = []
    for r in rows:
        if r["link"] == "veth" and r["tcp_only"] and r["veth_share"] < CROSSED_MIN:
            bad.append(
                f"round {r['round']} {r['config']}: only {100 * r['veth_share']:.1f}% of the payload "
                f"crossed the veth (expected >= {100 * CROSSED_MIN:.0f}%)"
            )
        if r["link"] == "lo" and r["veth_share"] > LOOPBACK_MAX:
            bad.append(
                f"round {r['round']} {r['config']}: {100 * r['veth_share']:.1f}% of the payload crossed "
                f"the veth on a loopback run"
            )
    return bad


def _per_round(rs: List[dict], base: List[dict]) -> List[float]:
    """samples/s of each run in ``rs`` over that of the ``base`` run of its round."""
    by_round = {b["round"]: b["samples_s"] for b in base}
    return [r["samples_s"] / by_round[r["round"]] for r in rs if r["round"] in by_round]


def table(rows: List[dict], configs: Sequence[str]) -> str:
    """The markdown table: per configuration, medians [min-max] over rounds, ratios against the same link's
    peers."""
    by = {c: [r for r in rows if r["config"] == c] for c in configs}
    lines = [
        "| configuration | link | samples/s | vs DDP, same link | vs torch rpc PS (TCP), same link | "
        "MB over the veth per step | of the payload | TCP conns across the veth | step ms | comm / update ms "
        "| "
        "other load, cores | loss first -> last |",
        "|---" * 12 + "|",
    ]
    for c in configs:
        rs = by[c]
        if not rs:
            continue
        cfg = CONFIGS[c]
        ddp = by.get(f"ddp-{cfg.link}", [])
        rpc = by.get(f"rpc-{cfg.link}" if cfg.link == "veth" else "rpc-lo-tcp", [])
        vs_ddp = _per_round(rs, ddp) if cfg.system != "ddp" else []
        vs_rpc = _per_round(rs, rpc) if rpc and rs is not rpc else []
        losses = rs[0]["losses_first_last"]
        lines.append(
            "| "
            + " | ".join(
                [
                    c,
                    "veth (across hosts)" if cfg.link == "veth" else "loopback (1 host)",
                    med([r["samples_s"] for r in rs], ".0f"),
                    med(vs_ddp, ".2f") if vs_ddp else "-",
                    med(vs_rpc, ".2f") if vs_rpc else "-",
                    med([r["veth_mb_step"] for r in rs], ".1f"),
                    f"{100 * statistics.median(r['veth_share'] for r in rs):.1f}%",
                    str(max(r["veth_tcp_conns_peak"] for r in rs)),
                    f"{statistics.median(r['step_ms'] for r in rs):.0f}",
                    f"{statistics.median(r['update_ms'] for r in rs):.0f}",
                    med([r["other_load"] for r in rs], ".2f"),
                    f"{losses[0]:.4f} -> {losses[1]:.4f}",
                ]
            )
            + " |"
        )
    legend = [f"- `{c}`: {CONFIGS[c].what}" for c in configs] + [
        "- samples/s: both trainers' samples / the slower one's timed wall time; ratios: per round, "
        "against the same link's DDP and TCP-only torch rpc PS run.",
        "- MB over the veth per step: what every host's interface sent over the whole run (start included) "
        "per warm-up and timed step; of the payload: what the layout must move between hosts (PS, 2 trainers "
        "x (gradients + parameters) x the share of trainer-pserver pairs on different hosts; DDP, one rank "
        "per "
        "host, 2 x the model). TCP conns: peak of trainer 0's host's established "
        "connections to the other hosts (mpt_uv opens 16 lanes per TensorPipe pipe).",
        "- comm / update ms: this product, `tr.step()` (push, sync wait, pull); torch rpc PS, the wait for "
        "`update_and_fetch`; DDP, `opt.step()` only (its all-reduce overlaps backward, in the step time).",
        "- other load: CPU cores busy with anything but this benchmark during the run (from /proc/stat).",
    ]
    return "\n".join(lines + [""] + legend)
