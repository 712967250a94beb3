"""Figures and tables of the dense benchmark: one row per run, medians per configuration."""

from __future__ import annotations

import statistics
from typing import Dict, List, Sequence

from benchmarks.jobs.dense_workers import Spec


def label(config: str, processes: int, per_node: int, pservers: int) -> str:
    """The table name of ``config`` for a job of ``processes`` worker processes."""
    if config == "ddp":
        return f"DDP / gloo, {processes} procs"
    mode = config.split("-")[1]
    if config.endswith("-node"):
        return f"ours, {mode}, {processes // per_node} nodes x {per_node} procs ({pservers} ps)"
    return f"ours, {mode} ({pservers} ps x {processes} tr)"


def _mean(workers: List[dict], key: str, per_step: bool = True) -> float:
    """Mean over workers of ``key`` (per timed step when ``per_step``)."""
    return sum(w[key] / (w["steps"] if per_step else 1) for w in workers) / len(workers)


def _pushed_per_group(workers: List[dict], group_of) -> float:
    """Bytes pushed per timed step, summed within each group (``group_of(worker)``), mean over groups."""
    groups: Dict[int, float] = {}
    for w in workers:
        g = group_of(w)
        groups[g] = groups.get(g, 0.0) + w["bytes_pushed"] / w["steps"]
    return sum(groups.values()) / len(groups)


def summarize(config: str, spec: Spec, workers: List[dict], servers: List[dict], per_node: int = 1) -> dict:
    """The figures of one run from its workers' and servers' results (times in ms per step).

    ``per_node`` is the job's ``L``: the bytes pushed per ``L`` consecutive
    global ranks (one host) are counted for every PS configuration.
    """
    row = {
        "config": config,
        "samples_s": sum(spec.batch * w["steps"] for w in workers) / max(w["wall_s"] for w in workers),
        "step_ms": 1e3 * _mean(workers, "wall_s"),
        "compute_ms": 1e3 * _mean(workers, "compute_s"),
        "update_ms": 1e3 * _mean(workers, "update_s"),
        "update_pct": 100
        * sum(w["update_s"] / (w["compute_s"] + w["update_s"]) for w in workers)
        / len(workers),
        "cpu_ms": 1e3 * _mean(workers, "cpu_s"),
        "main_cpu_ms": 1e3 * _mean(workers, "main_cpu_s"),
        "sys_cpu_ms": 1e3 * _mean(workers, "sys_s"),
        "losses": {w["rank"]: w["losses"] for w in workers},
    }
    if "bytes_pushed" in workers[0]:
        moved = [w["bytes_pushed"] + w["bytes_pulled"] for w in workers]
        row["gbps"] = sum(b / w["update_s"] for b, w in zip(moved, workers)) / len(workers) / 1e9
        row["mb_per_step"] = sum(b / w["steps"] for b, w in zip(moved, workers)) / len(workers) / 1e6
        row["mb_pushed_proc"] = _pushed_per_group(workers, lambda w: w["rank"]) / 1e6
        row["mb_pushed_node"] = _pushed_per_group(workers, lambda w: w["node"]) / 1e6
        row["mb_pushed_host"] = _pushed_per_group(workers, lambda w: w["rank"] // per_node) / 1e6
        for phase in ("push_wait", "pull_recv"):  # per pserver call, a process's calls run in parallel
            row[f"{phase}_ms"] = (
                1e3 * sum(w[f"{phase}_s"] / w["steps"] / w["pserver_calls"] for w in workers) / len(workers)
            )
        if "node_coll_s" in workers[0]:
            row["node_coll_ms"] = 1e3 * _mean(workers, "node_coll_s")
    if servers:
        steps = spec.warmup + spec.steps
        row["ps_cpu_ms"] = 1e3 * _mean(servers, "cpu_s", False) / steps
        row["ps_sys_cpu_ms"] = 1e3 * _mean(servers, "sys_s", False) / steps
    return row


def med(values: Sequence[float], fmt: str) -> str:
    """'median [min-max]' of ``values`` with format ``fmt``."""
    return f"{format(statistics.median(values), fmt)} [{format(min(values), fmt)}-{format(max(values), fmt)}]"


# (header, row key, format, with [min-max]) of the tables.
THROUGHPUT = [
    ("samples/s", "samples_s", ".0f", True),
    ("push+pull GB/s per process", "gbps", ".3f", True),
    ("MB moved per process step", "mb_per_step", ".1f", False),
    ("other load, cores", "other_load", ".2f", True),
]
TIME_SPLIT = [
    ("step", "step_ms", ".0f", False),
    ("fwd+bwd", "compute_ms", ".0f", True),
    ("update", "update_ms", ".0f", True),
    ("share in update %", "update_pct", ".0f", False),
    ("push + wait for 1st tensor", "push_wait_ms", ".0f", False),
    ("receive rest", "pull_recv_ms", ".0f", False),
    ("node reduce-scatter + all-gather", "node_coll_ms", ".0f", False),
    ("worker CPU", "cpu_ms", ".0f", False),
    ("of it main thread", "main_cpu_ms", ".0f", False),
    ("pserver CPU (each)", "ps_cpu_ms", ".0f", False),
]


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


def _per_round(rs: List[dict], base: List[dict], key: str) -> List[float]:
    """``r[key] / b[key]`` of each run ``r`` against the ``base`` run of its round."""
    by_round = {b["round"]: b[key] for b in base if key in b}
    return [r[key] / by_round[r["round"]] for r in rs if r["round"] in by_round and key in r]


def tables(
    rows: List[dict], configs: Sequence[str], processes: int = 2, per_node: int = 1, pservers: int = 2
) -> str:
    """Markdown tables, medians over runs: throughput vs DDP, time split; with trainer nodes also
    samples/s and bytes pushed of each node configuration vs the plain trainers of its mode."""
    name = {c: label(c, processes, per_node, pservers) for c in configs}
    by = {c: [r for r in rows if r["config"] == c] for c in configs}
    ddp_rows = by.get("ddp", [])
    ddp = statistics.median(r["samples_s"] for r in ddp_rows) if ddp_rows else None
    nodes = any(c.endswith("-node") for c in configs)
    head = [
        "| configuration | samples/s | vs DDP (ratio of medians) | vs DDP (per-round ratios) | "
        + ("vs plain trainers (per-round ratios) | " if nodes else "")
        + " | ".join(h for h, *_ in THROUGHPUT[1:])
        + " |",
        "|---" * (len(THROUGHPUT) + 3 + nodes) + "|",
    ]
    for c in configs:
        rs = by[c]
        cells = _cells(rs, THROUGHPUT)
        paired = _per_round(rs, ddp_rows, "samples_s")
        sps = statistics.median(r["samples_s"] for r in rs)
        ratio = [
            f"{sps / ddp:.2f}x" if ddp and c != "ddp" else "-",
            med(paired, ".2f") if paired and c != "ddp" else "-",
        ]
        if nodes:
            vs_plain = (
                _per_round(rs, by.get(c[: -len("-node")], []), "samples_s") if c.endswith("-node") else []
            )
            ratio.append(med(vs_plain, ".2f") if vs_plain else "-")
        head.append("| " + " | ".join([name[c], cells[0], *ratio, *cells[1:]]) + " |")
    out = "\n".join(head)
    ps = [c for c in configs if c != "ddp"]
    if nodes:  # bytes pushed: node vs plain trainers
        lines = [
            f"| configuration | MB pushed per process step | MB pushed per node step (pservers' trainer) | "
            f"MB pushed per {per_node} processes step | node / plain, per {per_node} processes |",
            "|---" * 5 + "|",
        ]
        for c in ps:
            cells = _cells(
                by[c],
                [(None, k, ".1f", False) for k in ("mb_pushed_proc", "mb_pushed_node", "mb_pushed_host")],
            )
            plain = by.get(c[: -len("-node")], []) if c.endswith("-node") else []
            ratio = _per_round(by[c], plain, "mb_pushed_host")
            lines.append(
                "| "
                + " | ".join([name[c], *cells, f"{statistics.median(ratio):.3f}" if ratio else "-"])
                + " |"
            )
        out += "\n\n" + "\n".join(lines)
    columns = [col for col in TIME_SPLIT if nodes or col[1] != "node_coll_ms"]
    split = [
        "| configuration (ms per step, medians) | " + " | ".join(h for h, *_ in columns) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    for c in configs:
        split.append("| " + " | ".join([name[c], *_cells(by[c], columns)]) + " |")
    return out + "\n\n" + "\n".join(split)


def loss_check(rows: List[dict]) -> Dict[str, float]:
    """Per sync PS configuration, the largest |loss difference| with DDP at the same global rank and step.

    Sync PS with SGD must train exactly like DDP (float rounding aside), so
    this shows both systems ran the same job; a trainer node averages within
    the node first, so its figure may differ by rounding.
    """
    ddp = {r["round"]: r["losses"] for r in rows if r["config"] == "ddp"}
    worst: Dict[str, float] = {}
    for r in rows:
        if r["config"].startswith("ps-sync") and r["round"] in ddp:
            for rank, losses in r["losses"].items():
                diff = max(abs(a - b) for a, b in zip(losses, ddp[r["round"]][rank]))
                worst[r["config"]] = max(worst.get(r["config"], 0.0), diff)
    return worst
