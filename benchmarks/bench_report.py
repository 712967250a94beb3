"""Figures and tables of the dense benchmark: one row per run, medians per configuration."""
from __future__ import annotations

import statistics
from typing import List, Optional, Sequence

from dense_workers import Spec

LABELS = {"ddp": "DDP / gloo, 2 procs", "ps-sync": "ours, sync (2 ps x 2 tr)",
          "ps-async": "ours, async (2 ps x 2 tr)"}


def _mean(workers: List[dict], key: str, per_step: bool = True) -> float:
    """Mean over workers of ``key`` (per timed step when ``per_step``)."""
    return sum(w[key] / (w["steps"] if per_step else 1) for w in workers) / len(workers)


def summarize(config: str, spec: Spec, workers: List[dict], servers: List[dict]) -> dict:
    """The figures of one run from its workers' and servers' results (times in ms per step)."""
    row = {
        "config": config,
        "samples_s": sum(spec.batch * w["steps"] for w in workers) / max(w["wall_s"] for w in workers),
        "step_ms": 1e3 * _mean(workers, "wall_s"),
        "compute_ms": 1e3 * _mean(workers, "compute_s"),
        "update_ms": 1e3 * _mean(workers, "update_s"),
        "update_pct": 100 * sum(w["update_s"] / (w["compute_s"] + w["update_s"])
                                for w in workers) / len(workers),
        "cpu_ms": 1e3 * _mean(workers, "cpu_s"),
        "main_cpu_ms": 1e3 * _mean(workers, "main_cpu_s"),
        "sys_cpu_ms": 1e3 * _mean(workers, "sys_s"),
        "losses": {w["rank"]: w["losses"] for w in workers},
    }
    if "bytes_pushed" in workers[0]:
        moved = [w["bytes_pushed"] + w["bytes_pulled"] for w in workers]
        row["gbps"] = sum(b / w["update_s"] for b, w in zip(moved, workers)) / len(workers) / 1e9
        row["mb_per_step"] = sum(b / w["steps"] for b, w in zip(moved, workers)) / len(workers) / 1e6
        for phase in ("push_wait", "pull_recv"):  # per pserver call, calls run in parallel
            row[f"{phase}_ms"] = 1e3 * _mean(workers, f"{phase}_s") / workers[0]["pservers"]
    if servers:
        steps = spec.warmup + spec.steps
        row["ps_cpu_ms"] = 1e3 * _mean(servers, "cpu_s", False) / steps
        row["ps_sys_cpu_ms"] = 1e3 * _mean(servers, "sys_s", False) / steps
    return row


def med(values: Sequence[float], fmt: str) -> str:
    """'median [min-max]' of ``values`` with format ``fmt``."""
    return (f"{format(statistics.median(values), fmt)} "
            f"[{format(min(values), fmt)}-{format(max(values), fmt)}]")


# (header, row key, format, with [min-max]) of the two tables.
THROUGHPUT = [("samples/s", "samples_s", ".0f", True),
              ("push+pull GB/s per trainer", "gbps", ".3f", True),
              ("MB moved per trainer step", "mb_per_step", ".1f", False),
              ("other load, cores", "other_load", ".2f", True)]
TIME_SPLIT = [("step", "step_ms", ".0f", False), ("fwd+bwd", "compute_ms", ".0f", True),
              ("update", "update_ms", ".0f", True), ("share in update %", "update_pct", ".0f", False),
              ("push + wait for 1st tensor", "push_wait_ms", ".0f", False),
              ("receive rest", "pull_recv_ms", ".0f", False),
              ("worker CPU", "cpu_ms", ".0f", False), ("of it main thread", "main_cpu_ms", ".0f", False),
              ("pserver CPU (each)", "ps_cpu_ms", ".0f", False)]


def _cells(rs: List[dict], columns) -> List[str]:
    """Table cells of one configuration's runs: median (and [min-max]) per column, '-' if absent."""
    out = []
    for _, key, fmt, spread in columns:
        values = [r[key] for r in rs if key in r]
        if not values:
            out.append("-")
        else:
            out.append(med(values, fmt) if spread else format(statistics.median(values), fmt))
    return out


def tables(rows: List[dict], configs: Sequence[str]) -> str:
    """Two markdown tables, medians over runs: throughput vs DDP, and the time split per step."""
    by = {c: [r for r in rows if r["config"] == c] for c in configs}
    ddp_by_round = {r["round"]: r["samples_s"] for r in by.get("ddp", [])}
    ddp = statistics.median(ddp_by_round.values()) if ddp_by_round else None
    head = ["| configuration | " + " | ".join(h for h, *_ in THROUGHPUT[:1])
            + " | vs DDP (ratio of medians) | vs DDP (per-round ratios) | "
            + " | ".join(h for h, *_ in THROUGHPUT[1:]) + " |",
            "|---" * (len(THROUGHPUT) + 3) + "|"]
    for c in configs:
        rs = by[c]
        paired = [r["samples_s"] / ddp_by_round[r["round"]] for r in rs if r["round"] in ddp_by_round]
        sps = statistics.median(r["samples_s"] for r in rs)
        cells = _cells(rs, THROUGHPUT)
        ratio = [f"{sps / ddp:.2f}x" if ddp and c != "ddp" else "-",
                 med(paired, ".2f") if paired and c != "ddp" else "-"]
        head.append("| " + " | ".join([LABELS[c], cells[0], *ratio, *cells[1:]]) + " |")
    split = ["| configuration (ms per step, medians) | " + " | ".join(h for h, *_ in TIME_SPLIT) + " |",
             "|---" * (len(TIME_SPLIT) + 1) + "|"]
    for c in configs:
        split.append("| " + " | ".join([LABELS[c], *_cells(by[c], TIME_SPLIT)]) + " |")
    return "\n".join(head) + "\n\n" + "\n".join(split)


def loss_check(rows: List[dict]) -> Optional[float]:
    """Largest |loss difference| between PS sync and DDP at the same rank and step, or None.

    Sync PS with SGD must train exactly like DDP (float rounding aside), so
    this shows both systems ran the same job.
    """
    ddp = {r["round"]: r["losses"] for r in rows if r["config"] == "ddp"}
    worst = None
    for r in rows:
        if r["config"] == "ps-sync" and r["round"] in ddp:
            for rank, losses in r["losses"].items():
                diff = max(abs(a - b) for a, b in zip(losses, ddp[r["round"]][rank]))
                worst = diff if worst is None else max(worst, diff)
    return worst
