"""Benchmark instrumentation: counters and timers wrapped around a live Trainer or pserver.

Nothing in the library changes: each wraps methods on one instance (a Trainer's pserver channels,
a module's forward, a ParameterServer's servicer and engine) and sums what it sees, thread-safely.
``job_s.py`` uses them to report calls, bytes and a step's phases on both sides.
"""

from __future__ import annotations

import threading
import time
import types
from typing import Dict

from torch import nn

from pserver.rpc.parking import parks


class CallCounter:
    """Counts the calls a Trainer makes to pservers through its channels (``tr.channels``).

    Benchmark instrumentation only: it wraps ``push_pull``, ``pull``,
    ``prefetch`` and ``heartbeat`` on each pserver's channel instance
    (nothing in the library changes), counting calls per method and the id
    bytes a separate prefetch sends (``bytes_pushed`` counts pushes only).
    Thread-safe: the calls to different pservers run on the channels' threads.
    """

    METHODS = ("push_pull", "pull", "prefetch", "heartbeat")

    def __init__(self, channels, endpoints):
        self.channels = channels
        self.calls = {m: 0 for m in self.METHODS}
        self.prefetch_bytes = 0
        self._lock = threading.Lock()
        for ep in endpoints:
            channel = channels[ep]
            for name in self.METHODS:
                setattr(channel, name, self._wrap(name, getattr(channel, name)))

    def _wrap(self, name: str, call):
        def counted(*args, **kwargs):
            with self._lock:
                self.calls[name] += 1
                if name == "prefetch":  # prefetch(min_step, ids, dtype_and_shape)
                    ids = args[1] if len(args) > 1 else kwargs.get("ids", ())
                    self.prefetch_bytes += sum(t.numel() * t.element_size() for _, t in ids)
            return call(*args, **kwargs)

        return counted

    def snapshot(self) -> Dict[str, int]:
        """Calls per method, step calls (all but heartbeats), bytes pushed (with prefetched ids) and
        pulled."""
        with self._lock:
            calls = dict(self.calls)
            prefetch_bytes = self.prefetch_bytes
        return {
            **{f"{m}_calls": n for m, n in calls.items()},
            "calls": sum(n for m, n in calls.items() if m != "heartbeat"),
            "bytes_pushed": self.channels.bytes_pushed + prefetch_bytes,
            "bytes_pulled": self.channels.bytes_pulled,
        }


class LookupTimer:
    """Wall time spent in a module's forward (the distributed table's lookups), summed in ``seconds``."""

    def __init__(self, module: nn.Module):
        self.seconds = 0.0
        self._t0 = 0.0
        module.register_forward_pre_hook(self._pre)
        module.register_forward_hook(self._post)

    def _pre(self, module, args):
        self._t0 = time.perf_counter()

    def _post(self, module, args, out):
        self.seconds += time.perf_counter() - self._t0


class PserverPhases:
    """A pserver's CPU per push, phase by phase, over the trainers' timed steps (instrumentation only).

    Wraps, on the instance, the servicer's one-message step calls (its data calls' ``PushPullOne``,
    ``PushPullShared``: the whole handler) and the parts it runs in its handler thread: reading the
    request (``_read_stream``, ``deal_lanes``: decode), the engine's ``push`` (apply; a sync barrier's
    wait takes no CPU), ``read`` (the blocks of the answer) and ``lookup`` (the next batch's rows), each
    timed with ``time.thread_time`` (the calling thread's CPU). What the handler spends outside them is
    checking and encoding the answer; what the process spends outside the handlers is gRPC's own threads
    and the rest. Counting starts at push ``first`` and stops at push ``last`` (the timed steps of every
    trainer); :meth:`summary` gives CPU ms per push.

    ``timed`` False: only the process's CPU per push, the handlers merely counted. Each phase's timers
    cost the pserver a few µs a call (``thread_time`` is a system call), tens of µs a push: a headline
    figure is measured without them.
    """

    PARTS = ("decode", "apply", "apply: tables", "read blocks", "lookup")

    def __init__(self, server, first: int, last: int, timed: bool = True):
        self.first, self.last = first, last
        self.timed = timed
        self.pushes = 0
        self.cpu = {p: 0.0 for p in (*self.PARTS, "handler")}
        self.process = [0.0, 0.0]
        self._lock = threading.Lock()
        sv, engine = server.servicer.data, server.engine
        sv._read_stream = self._timed("decode", sv._read_stream)
        sv.contents.sort_push = self._timed("decode", sv.contents.sort_push)
        engine.push = self._timed("apply", engine.push)
        engine.tables.apply = self._timed("apply: tables", engine.tables.apply)
        engine.read = self._timed("read blocks", engine.read)
        engine.lookup = self._timed("lookup", engine.lookup)
        sv.PushPullOne = self._handler(sv.PushPullOne)
        sv.PushPullShared = self._handler(sv.PushPullShared)
        channel = server._data_port.calls  # the data channel's push-pulls (data_channel=True)
        channel.payloads.push = self._timed("decode", channel.payloads.push)
        channel._push_pull = self._stretches(channel._push_pull)

    def _counting(self) -> bool:
        return self.first <= self.pushes < self.last

    def _timed(self, part: str, fn):
        if not self.timed:
            return fn

        def timed(*args, **kwargs):
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                if self._counting():
                    with self._lock:
                        self.cpu[part] += time.thread_time() - t0

        return timed

    def _handler(self, method):
        """Time a step call's handler, a parking generator (pserver/rpc/parking.py) run in stretches.

        The timed method stays a parking one (its ``parking`` generator, bound to the servicer), so the
        asyncio server still parks it: each stretch between waits is timed on the thread that runs it.
        """
        parking = method.parking

        def timed(servicer, request, context):
            yield from self._timed_stretches(parking(servicer, request, context))

        return types.MethodType(parks(stream=method.streams)(timed), method.__self__)

    def _stretches(self, call):
        """Time a data-channel push-pull, a generator a reactor runs in stretches (between its waits)."""
        return lambda *args: self._timed_stretches(call(*args))

    def _timed_stretches(self, answers):
        """``answers`` passed through, one push counted, and (when timed) the CPU of each stretch summed."""
        self._started()
        cpu = 0.0
        try:
            if not self.timed:
                yield from answers
                return
            while True:
                t0 = time.thread_time()
                try:
                    item = next(answers)
                except StopIteration:
                    return
                finally:
                    cpu += time.thread_time() - t0
                yield item
        finally:
            self._handled(cpu)

    def _started(self) -> None:
        with self._lock:
            if self.pushes == self.first:
                self.process[0] = time.process_time()

    def _handled(self, cpu: float) -> None:
        with self._lock:
            if self._counting():
                self.cpu["handler"] += cpu
            self.pushes += 1
            if self.pushes == self.last:
                self.process[1] = time.process_time()

    def summary(self) -> dict:
        """CPU ms per push of every phase, the handler's rest, and the process outside the handlers."""
        n = max(1, min(self.pushes, self.last) - self.first)
        if not self.timed:
            process = 1e3 * (self.process[1] - self.process[0]) / n if self.process[1] else float("nan")
            return {"pushes": n, "process_ms_per_push": process, "phases_ms_per_push": {}}
        ms = {p: 1e3 * self.cpu[p] / n for p in self.PARTS}
        ms["apply: dense blocks"] = ms.pop("apply") - ms["apply: tables"]
        handler = 1e3 * self.cpu["handler"] / n
        process = 1e3 * (self.process[1] - self.process[0]) / n if self.process[1] else float("nan")
        ms["checks and encoding the answer"] = handler - sum(ms.values())
        ms["outside the handler (transport, other threads)"] = process - handler
        return {"pushes": n, "process_ms_per_push": process, "phases_ms_per_push": ms}
