"""The machine a benchmark runs on: its CPU, and how busy other work kept it (the noise indicator).

On a shared machine a figure means little without the load that ran beside it, so every
benchmark reports its *other load*: CPU cores busy with anything but the benchmark and its
children (or stolen by the hypervisor) while it ran, from /proc/stat.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Tuple


def busy_cpu_seconds() -> Tuple[float, float]:
    """(CPU seconds the whole machine was busy or stolen, CPU seconds of this process and its
    reaped children), both since boot; on a system without /proc/stat the first is NaN."""
    mine = os.times()
    ours = mine.user + mine.system + mine.children_user + mine.children_system
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return float("nan"), ours
    # user nice system idle iowait irq softirq steal ...: all but idle and iowait are busy
    busy = sum(fields[:8]) - fields[3] - fields[4]
    return busy / os.sysconf("SC_CLK_TCK"), ours


class OtherLoad:
    """Measures a ``with`` block: ``cores``, the other load over it (cores, averaged), and ``wall`` (s).

    Children count as this benchmark's own once reaped, so the block should wait for the
    processes it starts.
    """

    cores = float("nan")
    wall = float("nan")

    def __enter__(self) -> "OtherLoad":
        self._busy, self._ours = busy_cpu_seconds()
        self._t0 = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        busy, ours = busy_cpu_seconds()
        self.wall = time.monotonic() - self._t0
        self.cores = max(0.0, (busy - self._busy) - (ours - self._ours)) / self.wall


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("unknown CPU" where it has none)."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"
