"""The report of ``bench_peers.py``: the all-peer table, the chart, and the scaling table, from its rows.

A row is one run of one system (``job``, ``system``, ``examples_s`` or an ``error``, and what
else the run measured); the ratios refer to TorchRec on job S (else the single process) and to
the better peer on job D.
"""

from __future__ import annotations

import statistics
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from benchmarks.reports.dense import med

LABELS = {
    ("S", "torch-local"): "PyTorch, 1 process (nn.Embedding sparse, batch 1024)",
    ("S", "torchrec"): "TorchRec 1.8, 2 processes (DMP over gloo, fbgemm CPU, SGD fused in backward)",
    ("S", "ours-async"): "this project, async (2 ps x 2 trainers)",
    ("S", "ours-async-plain"): "this project, async, the plain loop (no tr.batches(prefetch=))",
    ("S", "ours-sync"): "this project, sync (2 ps x 2 trainers)",
    ("S", "ours-sync-bf16"): "this project, sync, gradients pushed in bfloat16 (grad_wire_dtype)",
    ("S", "paddle-async"): "PaddlePaddle 2.6.2 PS, async (2 ps x 2 trainers)",
    ("S", "paddle-sync"): "PaddlePaddle 2.6.2 PS, sync (2 ps x 2 trainers)",
    ("D", "ddp"): "PyTorch DDP over gloo (2 processes)",
    ("D", "rpc-ps"): "torch.distributed.rpc PS (2 ps x 2 trainers)",
    ("D", "ours-sync"): "this project, sync (2 ps x 2 trainers)",
    ("D", "ours-sync-bf16"): "this project, sync, gradients pushed in bfloat16 (grad_wire_dtype)",
    ("D", "ours-collective"): "this project, collective mode (DDP through our Trainer, 2 processes)",
}
SHORT = {
    "torch-local": "PyTorch\n1 process",
    "torchrec": "TorchRec\n2 processes",
    "ours-async": "this project\nasync",
    "ours-async-plain": "this project\nasync, plain loop",
    "ours-sync": "this project\nsync",
    "ours-sync-bf16": "this project\nsync, bf16 push",
    "paddle-async": "Paddle PS\nasync",
    "paddle-sync": "Paddle PS\nsync",
    "ddp": "DDP\n(gloo)",
    "rpc-ps": "torch rpc\nPS",
    "ours-collective": "this project\ncollective (DDP)",
}
JOB_TITLES = {
    "S": "Job S: CTR, one dim-16 table, 2 trainers x 512",
    "D": "Job D: dense MLP 37.9 MB, 2 trainers x 256",
}


def median_range(values: Sequence[float], fmt: str) -> str:
    """'median [min-max]' of ``values`` (one value: just it)."""
    return format(values[0], fmt) if len(values) == 1 else med(values, fmt)


def short_error(message: str) -> str:
    """The first clause of a failure message, for a table cell."""
    first = message.splitlines()[0].split("; log ")[0].split(": log ")[0].rstrip(":; ")
    return first if len(first) <= 90 else first[:87] + "..."


def ok_runs(rows: Iterable[dict], job: str, system: str) -> List[dict]:
    """The successful runs of (job, system)."""
    return [r for r in rows if r["job"] == job and r["system"] == system and "error" not in r]


def baseline(rows: List[dict], job: str) -> Tuple[Optional[float], str]:
    """(the median a job's ratios refer to, its name): TorchRec, else the single process (S); the better
    peer (D)."""
    names = ["torchrec", "torch-local"] if job == "S" else ["ddp", "rpc-ps"]
    meds = {
        n: statistics.median(r["examples_s"] for r in ok_runs(rows, job, n))
        for n in names
        if ok_runs(rows, job, n)
    }
    if job == "S":
        if "torchrec" in meds:
            return meds["torchrec"], "TorchRec"
        return meds.get("torch-local"), "single process"
    if len(meds) < len(names):
        return None, "better peer"
    best = max(meds, key=meds.get)
    return meds[best], f"better peer ({best})"


def peers_table(rows: List[dict], pairs: Sequence[Tuple[str, str]], skipped: Dict[str, str]) -> str:
    """The markdown table of the all-peer run: one row per (job, system), medians with [min-max]."""
    lines = [
        "| job | system | examples/s (D: samples/s) median [min-max] | ratio | AUC | other load (cores) | "
        "runs |",
        "|---|---|---|---|---|---|---|",
    ]
    for job, system in pairs:
        runs = [r for r in rows if r["job"] == job and r["system"] == system]
        good = ok_runs(rows, job, system)
        label = LABELS[(job, system)]
        if system.startswith("ours"):
            label = f"**{label}**"
        if not good:
            why = skipped.get(system) or (short_error(runs[0]["error"]) if runs else "not run")
            lines.append(f"| {job} | {label} | failed: {why} | - | - | - | 0/{len(runs)} |")
            continue
        speeds = [r["examples_s"] for r in good]
        base, base_name = baseline(rows, job)
        ratio = f"{statistics.median(speeds) / base:.2f}x {base_name}" if base else "-"
        aucs = [r["auc"] for r in good if r.get("auc") is not None]
        auc = f"{statistics.median(aucs):.3f}" if aucs else "-"
        loads = [r["other_load"] for r in good]
        lines.append(
            f"| {job} | {label} | {median_range(speeds, ',.0f')} | {ratio} | {auc} | "
            f"{median_range(loads, '.2f')} | {len(good)}/{len(runs)} |"
        )
    return "\n".join(lines)


def chart(rows: List[dict], pairs: Sequence[Tuple[str, str]], path: str, subtitle: str) -> None:
    """The PNG: one panel per job, bars = median examples/s per system, min-max error bars, ours
    highlighted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    jobs = [j for j in ("S", "D") if any(p[0] == j for p in pairs)]
    fig, axes = plt.subplots(1, len(jobs), figsize=(6.2 * len(jobs), 4.8), squeeze=False)
    for ax, job in zip(axes[0], jobs):
        systems = [s for j, s in pairs if j == job]
        meds, lo, hi, colors = [], [], [], []
        for s in systems:
            v = [r["examples_s"] for r in ok_runs(rows, job, s)] or [0.0]
            m = statistics.median(v)
            meds.append(m)
            lo.append(m - min(v))
            hi.append(max(v) - m)
            colors.append("#d62728" if s.startswith("ours") else "#7f8fa6")
        x = range(len(systems))
        ax.bar(x, meds, yerr=[lo, hi], capsize=5, color=colors, edgecolor="black", linewidth=0.6)
        base, base_name = baseline(rows, job)
        for i, m in enumerate(meds):
            text = f"{m:,.0f}" + (f"\n{m / base:.2f}x" if base and m else "") if m else "n/a"
            ax.text(i, m + hi[i] + 0.01 * max(meds + [1.0]), text, ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(x))
        ax.set_xticklabels([SHORT.get(s, s) for s in systems], fontsize=8)
        ax.set_ylabel("examples/s (median, min-max)" if job == "S" else "samples/s (median, min-max)")
        ax.set_title(JOB_TITLES[job] + (f"\nratios: to the {base_name}" if base else ""), fontsize=9)
        ax.set_ylim(0, max(m + h for m, h in zip(meds, hi)) * 1.22 + 1)
        ax.grid(axis="y", alpha=0.3)
    from matplotlib.patches import Patch

    fig.legend(
        handles=[Patch(color="#d62728", label="this project"), Patch(color="#7f8fa6", label="peers")],
        loc="upper right",
        fontsize=8,
        frameon=False,
    )
    fig.suptitle(subtitle, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def scaling_table(rows: List[dict], configs: Sequence[Tuple[int, int]]) -> str:
    """The markdown scaling table: per (pservers, trainers), examples/s and per trainer per step figures."""
    lines = [
        "| pservers | trainers | global batch | examples/s median [min-max] | vs 1x1 | "
        "calls / trainer / step | KB pushed / trainer / step | KB pulled / trainer / step | "
        "other load (cores) | runs |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    ref = [r["examples_s"] for r in rows if (r["pservers"], r["trainers"]) == (1, 1) and "error" not in r]
    ref_med = statistics.median(ref) if ref else None
    for ps, tr in configs:
        runs = [r for r in rows if (r["pservers"], r["trainers"]) == (ps, tr)]
        good = [r for r in runs if "error" not in r]
        if not good:
            why = short_error(runs[0]["error"]) if runs else "not run"
            lines.append(f"| {ps} | {tr} | {512 * tr} | failed: {why} | - | - | - | - | - | 0/{len(runs)} |")
            continue
        speeds = [r["examples_s"] for r in good]

        def median_of(key: str, scale: float = 1.0) -> float:
            return statistics.median(r[key] for r in good) / scale

        vs = f"{statistics.median(speeds) / ref_med:.2f}x" if ref_med else "-"
        lines.append(
            f"| {ps} | {tr} | {good[0]['global_batch']} | {median_range(speeds, ',.0f')} | {vs} | "
            f"{median_of('calls_per_step'):.2f} | {median_of('bytes_pushed_per_step', 1e3):,.0f} | "
            f"{median_of('bytes_pulled_per_step', 1e3):,.0f} | "
            f"{median_range([r['other_load'] for r in good], '.2f')} | {len(good)}/{len(runs)} |"
        )
    return "\n".join(lines)
