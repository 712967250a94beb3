"""Channels: a trainer's channel to every pserver, the threads their calls run on, and what goes to all at
once.

Transfers to different pservers run in parallel on a small thread pool (gRPC releases the GIL while bytes
move): two calls per pserver may run at once, a step sent in the background (async pipeline) and the next
step's prefetch; or a heartbeat, while the trainer is silent.
"""

from __future__ import annotations

import functools
import secrets
import time
from concurrent import futures
from typing import Callable, Dict, List, Optional, Union

from psproto import ps_pb2
from psproto.options import channel_options
from psproto.security import Security
from psproto.wire import TRAINER_METADATA
from transpiler import TrainerProgram

from ..errors import MOVED, PserverError
from .channel import PserverChannel
from .data.data_link import DataLink
from .data.payloads import PserverPayloads
from .narrowing import GradientNarrower
from .shard_link import TrainerIdentity
from .shared_regions import RegionPool


def results_of(calls: Dict[str, futures.Future]) -> Dict[str, object]:
    """Every call's result by endpoint, once all ended; the first failure is re-raised after the last ends."""
    results, error = {}, None
    for ep, fut in calls.items():
        try:
            results[ep] = fut.result()
        except Exception as e:  # surface after all finish, so none is left running
            error = error or e
    if error is not None:
        raise error
    return results


class Channels:
    """A :class:`PserverChannel` per pserver of ``program`` (``channels[endpoint]``) and the pool their
    calls use."""

    def __init__(self, program: TrainerProgram, security: Optional[Security] = None):
        cfg = program.config
        self.trainer_id = program.trainer_id
        self.endpoints: List[str] = list(program.pservers)
        # This process's identity at Hello; each pserver answers with the session every call carries.
        identity = TrainerIdentity(
            program.trainer_id, program.layout_digest, secrets.randbits(63) or 1, program.layout_epoch
        )
        security = security if security is not None else Security.from_env()
        # Hot standby: a primary cut off by the network is noticed by keepalive pings, not TCP's timeout.
        # Every call names its trainer process: the pserver notes it as a sign of life on arrival, queued or
        # not.
        open_channel = functools.partial(
            security.channel,
            options=channel_options(cfg.chunk_bytes, fast_keepalive=program.replicated),
            metadata=((TRAINER_METADATA, f"{program.trainer_id}:{identity.incarnation}"),),
        )
        self.narrower = GradientNarrower(cfg.grad_wire_dtype)
        self._regions = RegionPool()
        groups = program.replica_groups
        blocks = {ep: {b.name: b.nbytes for b in program.blocks if b.endpoint == ep} for ep in self.endpoints}
        self._by_endpoint = {
            ep: PserverChannel(
                ep,
                groups[ep],
                identity,
                cfg,
                open_channel,
                self._regions,
                self.narrower,
                blocks[ep],
                self._data_link(program, ep, security) if cfg.data_channel else None,
            )
            for ep in self.endpoints
        }
        self._pool = futures.ThreadPoolExecutor(
            max_workers=2 * len(self.endpoints), thread_name_prefix="trainer-comm"
        )

    @staticmethod
    def _data_link(program: TrainerProgram, endpoint: str, security: Security) -> DataLink:
        """The data connections to ``endpoint`` (docs/dataplane.md), opened on first use."""
        cfg = program.config
        payloads = PserverPayloads([b for b in program.blocks if b.endpoint == endpoint], program.tables)
        return DataLink(
            endpoint,
            payloads,
            security,
            program.trainer_id,
            program.layout_digest,
            cfg.shared_memory,
            cfg.push_lanes,
            cfg.push_lanes * cfg.chunk_bytes,
            cfg.connect_timeout,
        )

    def __getitem__(self, endpoint: str) -> PserverChannel:
        return self._by_endpoint[endpoint]

    @property
    def bytes_pushed(self) -> int:
        """Tensor bytes of every push that went through, as sent (narrowed)."""
        return sum(ch.bytes_pushed for ch in self._by_endpoint.values())

    @property
    def bytes_pulled(self) -> int:
        """Tensor bytes of every answer received."""
        return sum(ch.bytes_pulled for ch in self._by_endpoint.values())

    def sessions(self) -> Dict[str, str]:
        """The session each pserver's calls carry (what a node's leader hands its local ranks)."""
        return {ep: ch.session for ep, ch in self._by_endpoint.items()}

    def use_sessions(self, sessions: Dict[str, str]) -> None:
        """Carry ``sessions`` ({pserver: session}) from now on: the ones a node's leader opened."""
        for ep, session in sessions.items():
            self._by_endpoint[ep].use_session(session)

    def hello(self, timeout: float, join_at: int = 0) -> Dict[str, ps_pb2.HelloReply]:
        """Register with every pserver, waiting up to ``timeout`` s for each to come up.

        Returns each pserver's answer: its start_step (the step this trainer
        starts at), incarnation, checkpoint, this trainer's data position and
        session (kept by its channel; every later call carries it). Raises
        :class:`PserverUnavailableError` naming a pserver that never answered,
        or :class:`PserverError` if one refuses (e.g. plan mismatch, or another
        process running as this trainer id after one alive window of retries).
        ``join_at`` (sync, joining) tells a pserver one step behind that this
        trainer starts at that step: it finishes its own without waiting for it.
        """
        deadline = time.monotonic() + timeout
        jobs = {
            ep: self._pool.submit(ch.hello, deadline, timeout, join_at)
            for ep, ch in self._by_endpoint.items()
        }
        # A pserver that says the job moved speaks for all of them: one that left the job may be gone.
        for job in futures.as_completed(jobs.values()):
            error = job.exception()
            if isinstance(error, PserverError) and error.kind == MOVED:
                raise error
        return {ep: job.result() for ep, job in jobs.items()}

    def close(self, timeout: float = 0.0) -> Dict[str, int]:
        """Tell every pserver this trainer is done, then release everything; trainers left per pserver (-1:
        not told).

        A pserver that does not answer is asked again for up to ``timeout`` s (see
        :meth:`PserverChannel.close`).
        """
        deadline = time.monotonic() + timeout
        try:
            return self.run_parallel(
                {ep: functools.partial(ch.close, deadline) for ep, ch in self._by_endpoint.items()}
            )
        finally:
            self.shutdown()

    def stats(self, timeout: float) -> Dict[str, Union[ps_pb2.StatsReply, PserverError]]:
        """Every pserver's ``StatsReply`` (or the error that came instead), asked all at once, each within
        ``timeout`` s.

        Uses no pool thread: a push never waits behind an observer's call.
        """
        calls = {ep: ch.stats(timeout) for ep, ch in self._by_endpoint.items()}
        futures.wait(
            calls.values(), timeout=timeout + 1.0
        )  # each call has its deadline; this bounds the wait too
        out: Dict[str, Union[ps_pb2.StatsReply, PserverError]] = {}
        for ep, call in calls.items():
            try:
                out[ep] = call.result(timeout=0)
            except PserverError as e:
                out[ep] = e
            except futures.TimeoutError:
                out[ep] = PserverError(ep, f"Stats: no answer within {timeout:g}s")
        return out

    def submit(self, fn: Callable[[], object]) -> futures.Future:
        """Run ``fn`` on one of the pserver call threads."""
        return self._pool.submit(fn)

    def run_parallel(self, jobs: Dict[str, Callable[[], object]]) -> Dict[str, object]:
        """Run one callable per endpoint concurrently; re-raise the first failure once all ended.

        The last runs on the calling thread, which would only wait meanwhile: a step's push to two pservers
        costs one hand-over to a pool thread and back, not two.
        """
        if not jobs:
            return {}
        *others, (last, run_here) = jobs.items()
        calls = {ep: self._pool.submit(fn) for ep, fn in others}
        here: futures.Future = futures.Future()
        try:
            here.set_result(run_here())
        except Exception as e:  # reported after the others end, as theirs are
            here.set_exception(e)
        calls[last] = here
        return results_of({ep: calls[ep] for ep in jobs})

    def shutdown(self) -> None:
        """Release channels and threads (without telling the pservers)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        for ch in self._by_endpoint.values():
            ch.shutdown()
        self._regions.close()
