"""What a benchmark reads of another process in /proc: CPU seconds, resident memory, threads, and a sampler.

Linux only. ``cpu_seconds`` is user + system time (``/proc/<pid>/stat`` utime + stime);
``status`` reads ``/proc/<pid>/status``: ``VmRSS`` (resident now), ``VmHWM`` (the peak resident
size since the process started), ``RssAnon`` (of it, the process's private memory; the rest is files and
shared memory, such as the data channel's regions mapped from trainers) in bytes, and ``Threads``.
"""

from __future__ import annotations

import os
import threading
from typing import Dict, Sequence

TICKS = os.sysconf("SC_CLK_TCK")
_SIZES = {"VmRSS": "rss", "VmHWM": "hwm", "RssAnon": "anon"}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds ``pid`` has used (its threads included; its children not)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime: fields 14 and 15 of stat(5)


def status(pid: int) -> Dict[str, int]:
    """``{"rss": VmRSS bytes, "hwm": VmHWM bytes, "anon": RssAnon bytes, "threads": Threads}`` of
    ``pid``."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in _SIZES:
                out[_SIZES[key]] = int(value.split()[0]) * 1024
            elif key == "Threads":
                out["threads"] = int(value)
    return out


class Sampler:
    """Reads ``status`` of ``pids`` every ``interval`` s on a thread: the largest thread count, RSS and
    private memory (RssAnon) of each.

    A process that exited is no longer read. ``stop()`` ends the thread and returns ``{pid: {"threads":
    max, "rss": max, "anon": max}}``.
    """

    def __init__(self, pids: Sequence[int], interval: float = 0.05):
        self._pids = list(pids)
        self._interval = interval
        self.peaks = {pid: {"threads": 0, "rss": 0, "anon": 0} for pid in self._pids}
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="proc-sampler")

    def start(self) -> "Sampler":
        self._sample()
        self._thread.start()
        return self

    def _sample(self) -> None:
        for pid in self._pids:
            try:
                now = status(pid)
            except (OSError, ValueError):
                continue
            peak = self.peaks[pid]
            peak["threads"] = max(peak["threads"], now.get("threads", 0))
            peak["rss"] = max(peak["rss"], now.get("rss", 0))
            peak["anon"] = max(peak["anon"], now.get("anon", 0))

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            self._sample()

    def stop(self) -> Dict[int, Dict[str, int]]:
        self._stopped.set()
        self._thread.join(timeout=5.0)
        return self.peaks
