"""The emulated fan-in's figures from one run, and its markdown table (``benchmarks.bench_fanin``).

How each figure is measured (P pservers, K trainers, ``steps`` steps each):

- ``steps_per_s``: ``steps`` / the push window, from the first push sent to the last answer received
  (``time.monotonic()`` in the load generators: one clock for every process of a host);
  ``trainer_steps_per_s``: K x that.
- ``cpu_ms_per_push``: the pservers' user + system CPU (``/proc/<pid>/stat``) from just before the
  first push to just after the last answer, over the pushes their ``Stats`` counted meanwhile (K x steps
  each; a run whose count differs fails). Includes every call of that window: heartbeats and the
  benchmark's four Stats calls per pserver.
- ``threads_max``: the most ``Threads`` of ``/proc/<pid>/status`` seen in any pserver, sampled every
  50 ms from before the first Hello to the end; ``threads_idle``: with K idle sessions.
- ``rss_start_mb``: VmRSS of a pserver serving, before any Hello (mean over pservers);
  ``idle_kb_per_session``: (VmRSS with K idle sessions - at start) / K; ``step_holds_mb``: the
  peak resident size (VmHWM, and the sampled VmRSS) up to the last answer minus VmRSS with K idle
  sessions (in sync mode: what a step holds for its K pushes; ``step_holds_kb_per_trainer`` = that / K);
  ``step_holds_private_mb`` (``_kb_per_trainer``): the same of the private memory (RssAnon), without
  the data channel's shared-memory regions, which the trainers map and the pserver touches (about a
  push and an answer per connection: memory of the trainers' sessions, not of the step).
  ``table_growth_mb``: the rows the tables gained over the steps (``Stats.table_rows``, mean over
  pservers; ``table_rows_added``) times the bytes of a row (job S's: its id, 16 float32 values and its
  last step seen, 80 bytes; the index not counted: a lower bound), the model itself, which grows with
  every new id (K x steps); ``step_holds_beyond_tables_kb_per_trainer``: the private memory held less
  that, per trainer: at most what serving the step held.
- ``pushes_per_s``, ``prefetches_per_s``, ``heartbeats_per_s``: the pservers' Stats counters over the
  same window as the CPU, summed over pservers (sync: one prefetch per pserver is the check's read of the
  initial rows); ``heartbeats_per_trainer_min``: heartbeats per trainer per pserver per minute.
- ``push_p50_ms`` / ``push_p99_ms``: each push-pull's latency at its trainer, from the call to its
  answer received (sync: the wait for the other trainers included). ``release_p50_ms`` /
  ``release_p99_ms`` (sync): per pserver and step, each answer's arrival after the start of that step's
  LAST push-pull call to that pserver: the last push's transfer, the step's apply, and the answers to
  the K parked pushes.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np

MB = 1 << 20


def _ms(values: np.ndarray, q: float) -> float:
    return round(float(np.percentile(values, q)) * 1e3, 1)


def summarise(
    *,
    mode: str,
    k: int,
    spec,
    loads: int,
    pushes: np.ndarray,
    at_start: Sequence[dict],
    idle: Sequence[dict],
    stepped: Sequence[dict],
    peaks: Sequence[dict],
    cpu: np.ndarray,
    before: Dict[str, object],
    after: Dict[str, object],
    window: float,
    check: Optional[dict],
    row_bytes: int,
) -> dict:
    """One run's row: ``pushes`` holds (trainer, pserver index, step, start, end) per push-pull."""
    p = len(spec.pservers)
    start, end = pushes[:, 3], pushes[:, 4]
    wall = float(end.max() - start.min())
    counted = {
        kind: sum(getattr(after[ep], kind) - getattr(before[ep], kind) for ep in spec.pservers)
        for kind in ("pushes", "prefetches", "heartbeats")
    }
    row = {
        "mode": mode,
        "trainers": k,
        "pservers": p,
        "load_processes": loads,
        "in_flight": spec.in_flight,
        "steps": spec.steps,
        "batch": spec.batch,
        "push_window_s": round(wall, 3),
        "steps_per_s": round(spec.steps / wall, 3),
        "trainer_steps_per_s": round(k * spec.steps / wall, 1),
        "cpu_ms_per_push": round(1e3 * float(np.sum(cpu)) / counted["pushes"], 2),
        "cpu_s_per_pserver": [round(float(c), 2) for c in cpu],
        "threads_idle": max(s["threads"] for s in idle),
        "threads_max": max(s["threads"] for s in peaks),
        "rss_start_mb": round(float(np.mean([s["rss"] for s in at_start])) / MB, 1),
        "idle_kb_per_session": round(
            float(np.mean([(i["rss"] - s["rss"]) / k for i, s in zip(idle, at_start)])) / 1024, 1
        ),
    }
    held = float(np.mean([max(st["hwm"], pk["rss"]) - i["rss"] for st, pk, i in zip(stepped, peaks, idle)]))
    private = float(
        np.mean([max(st["anon"], pk["anon"]) - i["anon"] for st, pk, i in zip(stepped, peaks, idle)])
    )
    # The tables grow with every new id pushed (the model itself, linear in K x steps): their rows added
    # over the steps at ``row_bytes`` each (a lower bound: the index is not counted), so that what is left
    # is at most what serving the step held.
    added = float(np.mean([after[ep].table_rows - before[ep].table_rows for ep in spec.pservers]))
    tables = added * row_bytes
    row.update(
        {
            "table_rows_added": int(added),
            "table_growth_mb": round(tables / MB, 1),
            "step_holds_beyond_tables_kb_per_trainer": round((private - tables) / k / 1024, 1),
            "step_holds_mb": round(held / MB, 1),
            "step_holds_kb_per_trainer": round(held / k / 1024, 1),
            "step_holds_private_mb": round(private / MB, 1),
            "step_holds_private_kb_per_trainer": round(private / k / 1024, 1),
            "pushes_per_s": round(counted["pushes"] / window, 1),
            "prefetches_per_s": round(counted["prefetches"] / window, 1),
            "heartbeats_per_s": round(counted["heartbeats"] / window, 2),
            "heartbeats_per_trainer_min": round(counted["heartbeats"] / p / k / (window / 60.0), 2),
            "stats_window_s": round(window, 3),
            "push_p50_ms": _ms(end - start, 50),
            "push_p99_ms": _ms(end - start, 99),
        }
    )
    if mode == "sync":
        release = []
        for ep in range(p):
            for step in range(spec.steps):
                mine = (pushes[:, 1] == ep) & (pushes[:, 2] == step)
                release.append(end[mine] - start[mine].max())
        release = np.concatenate(release)
        row.update({"release_p50_ms": _ms(release, 50), "release_p99_ms": _ms(release, 99)})
    row["dropped"] = sum(
        len(after[ep].trainers_dropped) for ep in spec.pservers
    )  # a run with one fails before
    row["model_check"] = check
    return row


COLUMNS = [
    ("mode", "mode"),
    ("trainers", "K"),
    ("steps_per_s", "steps/s"),
    ("trainer_steps_per_s", "trainer steps/s"),
    ("cpu_ms_per_push", "CPU ms/push"),
    ("threads_idle", "threads idle"),
    ("threads_max", "threads max"),
    ("rss_start_mb", "RSS start MB"),
    ("idle_kb_per_session", "KB/idle session"),
    ("step_holds_mb", "peak-idle MB"),
    ("step_holds_kb_per_trainer", "KB/trainer"),
    ("step_holds_private_mb", "of it private MB"),
    ("step_holds_private_kb_per_trainer", "private KB/trainer"),
    ("table_growth_mb", "table growth MB"),
    ("step_holds_beyond_tables_kb_per_trainer", "private beyond tables KB/trainer"),
    ("pushes_per_s", "pushes/s"),
    ("prefetches_per_s", "prefetch/s"),
    ("heartbeats_per_s", "heartbeats/s"),
    ("heartbeats_per_trainer_min", "hb/trainer/pserver/min"),
    ("push_p50_ms", "push p50 ms"),
    ("push_p99_ms", "push p99 ms"),
    ("release_p50_ms", "release p50 ms"),
    ("release_p99_ms", "release p99 ms"),
]


def markdown_table(rows: List[dict]) -> str:
    """The runs as one markdown table (per pserver figures are means; ``-``: not measured in that mode)."""
    lines = [
        "| " + " | ".join(title for _, title in COLUMNS) + " | model check |",
        "|" + "---|" * (len(COLUMNS) + 1),
    ]
    for r in rows:
        check = r.get("model_check")
        verdict = (
            f"ok (max err {max(check['dense_max_error'], check['rows_max_error']):.1e})" if check else "-"
        )
        lines.append("| " + " | ".join(str(r.get(key, "-")) for key, _ in COLUMNS) + f" | {verdict} |")
    return "\n".join(lines)
