"""Hello and Close: how a trainer opens its session with every pserver and ends it.

A mixin of :class:`~trainer.communicator.calls.Communicator` (its channels,
stubs, sessions and :class:`~trainer.primaries.Primaries`). With hot standby a
shard's Hello goes to whichever of its processes leads (the Lead call).
"""
from __future__ import annotations

import logging
import time
from typing import Dict, Optional, Tuple

import grpc

from psproto import ps_pb2

from ..errors import PserverError, PserverUnavailableError
from psproto.wire import method_path

from .status import details, error_of

log = logging.getLogger(__name__)

# How often a waiting trainer says whom it waits for.
WAIT_LOG_INTERVAL = 5.0

# Close failures worth sending Close again for: the pserver died under the call or is coming back
# (UNAVAILABLE, DEADLINE_EXCEEDED), or restarted and no longer knows this trainer's session (ABORTED).
RETRY_CLOSE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED)



class SessionCalls:
    """Hello (to each shard's primary), Lead and Close of a communicator."""

    def _lead(self, address: str, timeout: float) -> Optional[Tuple[str, int]]:
        """Ask the process at ``address`` whether it leads its shard: (role, epoch), or None if it did not answer."""
        call = self._lead_calls.get(address)
        if call is None:
            channel = self._security.channel(address, self._options)
            call = self._lead_calls[address] = (channel, channel.unary_unary(
                method_path("Lead"), request_serializer=ps_pb2.LeadRequest.SerializeToString,
                response_deserializer=ps_pb2.LeadReply.FromString))
        try:
            reply = call[1](ps_pb2.LeadRequest(), timeout=timeout)
        except grpc.RpcError:
            return None
        return reply.role, reply.epoch

    def _hello_primary(self, endpoint: str, deadline: float, join_at: int = 0) -> int:
        """Hello to the process ``endpoint``'s calls now go to; the epoch it leads at."""
        reply = self._hello_one(endpoint, deadline, max(0.0, deadline - time.monotonic()), join_at)
        self._hello_replies[endpoint] = reply
        return reply.replica_epoch

    def hello(self, timeout: float, join_at: int = 0) -> Dict[str, ps_pb2.HelloReply]:
        """Register with every pserver, waiting up to ``timeout`` s for each to come up.

        Returns each pserver's answer: its start_step (the step this trainer
        starts at), incarnation, checkpoint, this trainer's data position and
        session (kept here; every later call carries it). Raises
        :class:`PserverUnavailableError` naming a pserver that never answered,
        or :class:`PserverError` if one refuses (e.g. plan mismatch, or another
        process running as this trainer id after one alive window of retries).
        ``join_at`` (sync, joining) tells a pserver one step behind that this
        trainer starts at that step: it finishes its own without waiting for it.
        """
        deadline = time.monotonic() + timeout
        jobs = {ep: self._pool.submit(self._hello_shard, ep, deadline, timeout, join_at) for ep in self._stubs}
        return {ep: job.result() for ep, job in jobs.items()}

    def _hello_shard(self, endpoint: str, deadline: float, timeout: float, join_at: int) -> ps_pb2.HelloReply:
        if not self.primaries.replicated(endpoint):
            return self._hello_one(endpoint, deadline, timeout, join_at)
        # Hot standby: whichever process leads now.
        self.primaries.follow(endpoint, self.primaries.generation[endpoint], deadline, join_at)
        return self._hello_replies[endpoint]

    def _hello_one(self, endpoint: str, deadline: float, timeout: float, join_at: int) -> ps_pb2.HelloReply:
        request = ps_pb2.HelloRequest(trainer_id=self.trainer_id, layout_digest=self.digest,
                                      incarnation=self.incarnation, join_at=join_at)
        next_log = 0.0
        last = "no answer"
        id_taken_until = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PserverUnavailableError(
                    endpoint, f"did not come up within {timeout:g}s (trainer {self.trainer_id}; "
                              f"last error: {last})")
            if time.monotonic() >= next_log:
                log.info("trainer %d: waiting for %s", self.trainer_id, endpoint)
                next_log = time.monotonic() + WAIT_LOG_INTERVAL
            try:
                reply = self._stubs[endpoint].Hello(request, timeout=min(remaining, WAIT_LOG_INTERVAL),
                                                    wait_for_ready=True)
                log.info("trainer %d: %s is up (step %d)", self.trainer_id, endpoint, reply.start_step)
                self.sessions[endpoint] = reply.session
                return reply
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.ALREADY_EXISTS:
                    # Another process holds this id. If it is this trainer's predecessor, killed
                    # moments ago, its session ages out within one alive window; a true duplicate
                    # is still there after it.
                    now = time.monotonic()
                    if id_taken_until is None:
                        id_taken_until = now + self.alive_window + self.heartbeat_interval
                    if now >= min(id_taken_until, deadline):
                        raise error_of(endpoint, f"refused Hello: {details(e)}", e) from None
                    last = details(e)
                    time.sleep(max(0.0, min(self.heartbeat_interval / 4, deadline - now)))
                    continue
                if e.code() == grpc.StatusCode.UNAVAILABLE and self.primaries.replicated(endpoint):
                    # Down, or a replica that does not lead: the caller asks the shard who leads.
                    raise error_of(endpoint, f"Hello: {details(e)}", e) from None
                # CANCELLED: a pserver shutting down cancels the calls it holds, a waiting Hello too.
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                    grpc.StatusCode.CANCELLED):
                    raise error_of(endpoint, f"refused Hello: {details(e)}", e) from None
                last = details(e)

    def close(self, timeout: float = 0.0) -> Dict[str, int]:
        """Tell every pserver this trainer is done; returns trainers left per pserver (-1: not told).

        A Close lost to a pserver that died under it (or that is restarting)
        is sent again for up to ``timeout`` s: a pserver restarted from a
        checkpoint written before this trainer's Close would otherwise wait for
        it, and never finish. A restarted pserver no longer knows this
        trainer's session, so the trainer says Hello to it first.
        """
        deadline = time.monotonic() + timeout
        try:
            return self.run_parallel({ep: (lambda ep=ep: self._close_one(ep, deadline)) for ep in self._stubs})
        finally:
            self.shutdown()

    def _close_one(self, endpoint: str, deadline: float) -> int:
        while True:
            generation = self.primaries.generation.get(endpoint, 0)
            request = ps_pb2.CloseRequest(trainer_id=self.trainer_id, session=self.sessions.get(endpoint, ""))
            remaining = deadline - time.monotonic()
            # While retrying, each try waits for the pserver a while (and logs), as Hello does.
            timeout = min(remaining, WAIT_LOG_INTERVAL) if remaining > 0 else min(self.rpc_timeout, 30.0)
            try:
                # Hot standby: no waiting for a dead primary to come back (its backup leads): UNAVAILABLE at once.
                ready = remaining > 0 and not self.primaries.replicated(endpoint)
                return self._stubs[endpoint].Close(request, timeout=timeout, wait_for_ready=ready).trainers_left
            except grpc.RpcError as e:
                code, remaining = e.code(), deadline - time.monotonic()
                if remaining > 0 and code in RETRY_CLOSE:
                    log.info("trainer %d: close at %s failed (%s); sending it again", self.trainer_id,
                             endpoint, details(e))
                    if code == grpc.StatusCode.UNAVAILABLE and self.primaries.replicated(endpoint):
                        try:  # hot standby: the shard's other process may lead now
                            self.primaries.follow(endpoint, generation, deadline)
                        except PserverError as follow_error:
                            log.warning("trainer %d: close at %s failed: %s", self.trainer_id, endpoint,
                                        follow_error)
                            return -1
                    elif code == grpc.StatusCode.ABORTED:  # a restarted pserver: a session first
                        try:
                            self._hello_one(endpoint, deadline, remaining, 0)
                        except PserverError as hello_error:
                            log.warning("trainer %d: close at %s failed: %s", self.trainer_id, endpoint,
                                        hello_error)
                            return -1
                    continue
                log.warning("trainer %d: close at %s failed: %s", self.trainer_id, endpoint, details(e))
                return -1
