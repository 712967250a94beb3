"""The GPU check's results: one row per stage, the table it prints and writes, and its exit code.

Pure logic (no torch, no processes), so it is tested table-driven on any machine.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Dict, Iterable, Mapping, Sequence

# A stage's outcome. A run gives "pass" or "fail"; a dry run "ready" (it would run) or "fail".
PASS, FAIL, READY = "pass", "fail", "ready"
OUTCOMES = (PASS, FAIL, READY)
# The modes of a check: a run on the GPU, the same stages on the CPU, or a dry run.
MODES = ("cuda", "cpu", "dry-run")


@dataclass
class StageResult:
    """One stage of the check: its key and name, outcome, figures, and wall-clock seconds.

    ``figures`` are short measured values (``{"max_abs_diff": 3e-7, "steps_per_s": 812.4}``);
    ``note`` says why a stage failed (the error, the deadline it missed) or what it leaves out.
    """

    key: str
    name: str
    outcome: str
    figures: Dict[str, object] = field(default_factory=dict)
    seconds: float = 0.0
    note: str = ""

    def __post_init__(self):
        if self.outcome not in OUTCOMES:
            raise ValueError(f"stage {self.key}: outcome must be one of {OUTCOMES}, got {self.outcome!r}")


def format_value(value: object) -> str:
    """A figure as the table shows it: floats to 4 significant digits (whole above 1,000), tiny and huge
    ones in e-notation."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e6):
            return f"{value:.2e}"
        return f"{value:.0f}" if abs(value) >= 1e3 else f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return "[" + " ".join(format_value(v) for v in value) + "]"
    return str(value)


def format_figures(figures: Mapping[str, object]) -> str:
    """``k=v, k=v`` in the figures' order (the stage lists the telling ones first)."""
    return ", ".join(f"{k}={format_value(v)}" for k, v in figures.items())


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell: no pipe, no line break."""
    return text.replace("|", "/").replace("\n", " ").strip()


def markdown_table(results: Sequence[StageResult]) -> str:
    """The one table: stage, result, figures, seconds (a failure's note follows its figures)."""
    lines = ["| stage | result | figures | seconds |", "|---|---|---|---|"]
    for r in results:
        figures = format_figures(r.figures)
        if r.note:
            figures = f"{figures}; {r.note}" if figures else r.note
        lines.append(f"| {r.key} {r.name} | {r.outcome} | {_cell(figures)} | {r.seconds:.1f} |")
    return "\n".join(lines)


def summary(results: Iterable[StageResult]) -> str:
    """``4 pass, 1 fail`` (outcomes in a fixed order, those with none left out)."""
    results = list(results)
    counts = [(o, sum(r.outcome == o for r in results)) for o in OUTCOMES]
    return ", ".join(f"{n} {o}" for o, n in counts if n) or "no stage"


def exit_code(results: Sequence[StageResult], mode: str) -> int:
    """0 when every stage came out as the mode expects (pass; a dry run: ready), else 1.

    A run that ran no stage is a failure too: a check that checked nothing must not look green.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not results:
        return 1
    expected = READY if mode == "dry-run" else PASS
    return 0 if all(r.outcome == expected for r in results) else 1


def report_markdown(results: Sequence[StageResult], header: Mapping[str, object]) -> str:
    """The Markdown file: a heading, the machine and mode as a list, the table, the summary line."""
    lines = ["# GPU check", ""]
    lines += [f"- {k}: {format_value(v)}" for k, v in header.items()]
    lines += ["", markdown_table(results), "", f"Result: {summary(results)}.", ""]
    return "\n".join(lines)


def report_json(results: Sequence[StageResult], header: Mapping[str, object]) -> str:
    """The JSON file: the header's fields, ``stages`` (every field of every row) and ``summary``."""
    return json.dumps(
        {**header, "stages": [asdict(r) for r in results], "summary": summary(results)}, indent=2, default=str
    )


# pytest's closing line: "3 passed, 1 failed, 2 skipped in 12.34s" (any order, any subset, -q or not).
_PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected|warnings?)\b")
_COLLECTED = re.compile(r"(\d+)(?:/\d+)? tests? collected")


def pytest_counts(output: str) -> Dict[str, int]:
    """The counts of pytest's last summary line in ``output`` (``error`` for errors; ``{}`` if none).

    Only the last line that names a count and a duration is read, so test names and log
    lines that happen to say "2 passed" earlier do not count.
    """
    for line in reversed(output.splitlines()):
        if " in " in line and _PYTEST_COUNT.search(line):
            counts: Dict[str, int] = {}
            for n, word in _PYTEST_COUNT.findall(line):
                word = {"errors": "error", "warnings": "warning"}.get(word, word)
                counts[word] = counts.get(word, 0) + int(n)
            return counts
    return {}


def collected_count(output: str) -> int:
    """How many tests ``pytest --collect-only -q`` listed: its "N tests collected" line, else -1."""
    for line in reversed(output.splitlines()):
        m = _COLLECTED.search(line)
        if m:
            return int(m.group(1))
    return -1


def pytest_outcome(counts: Mapping[str, int], returncode: int, device: str) -> bool:
    """Whether the CUDA tests passed: exit 0, nothing failed or errored, and on a GPU something ran.

    On the CPU every CUDA test is skipped: that is the expected outcome there, not a pass of nothing
    on a GPU machine, where skipped tests mean torch saw no GPU.
    """
    if returncode != 0 or counts.get("failed", 0) or counts.get("error", 0):
        return False
    if device == "cuda":
        return counts.get("passed", 0) > 0 and counts.get("skipped", 0) == 0
    return True
