"""PserverChannel: one pserver of the plan as this trainer reaches it: every call to it, in its session.

Its session starts with Hello and ends with Close; between them go the control calls, without tensors
(Heartbeat, Claim, Checkpoint, SaveTables, Restore, Reduce; Stats, read later), made here, and the
transfers (push-pull, pull, prefetch), made by :class:`~.tensor_calls.TensorCalls`. Every call has a
deadline, and every failure is re-raised as :class:`PserverError` naming the endpoint, the call and
what the pserver said. The channel composes its parts: the link to the pserver's shard (the process
calls go to, its session: :class:`~.shard_link.ShardLink`) and, with hot standby, the following of
the shard's primary (:class:`~.primaries.ShardPrimary`): a call that finds it gone goes again to the
process that leads now.
"""

from __future__ import annotations

import functools
import logging
import time
from concurrent import futures
from typing import Callable, Dict, Iterable, Optional, Sequence, Tuple

import grpc
import torch

from psproto import ps_pb2
from transpiler import DistributeTranspilerConfig

from ..errors import PserverError
from .contact import Contact
from .data.data_link import DataLink
from .data.started import StartedPush
from .narrowing import GradientNarrower
from .primaries import ShardPrimary
from .shard_link import WAIT_LOG_INTERVAL, ShardLink, TrainerIdentity
from .shared_regions import RegionPool
from .status_codes import details, error_of
from .tensor_calls import TensorCalls, wait_timeout
from .wire_paths import DecodeInto, DtypeAndShape, Named

log = logging.getLogger(__name__)

# Close failures worth sending Close again for: the pserver died under the call or is coming back
# (UNAVAILABLE, DEADLINE_EXCEEDED), or restarted and no longer knows this trainer's session (ABORTED).
RETRY_CLOSE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED)


class PserverChannel:
    """Every call this trainer makes to pserver ``endpoint`` (see the module doc).

    ``addresses``: the processes of its shard (itself, and its backup under
    hot standby); ``open_channel(address)`` makes a gRPC channel to one;
    ``blocks``: this pserver's blocks and their bytes (see :mod:`.lanes`); ``data``: the data connections
    to it (None: transfers go over gRPC).
    """

    def __init__(
        self,
        endpoint: str,
        addresses: Sequence[str],
        identity: TrainerIdentity,
        config: DistributeTranspilerConfig,
        open_channel: Callable[[str], grpc.Channel],
        regions: RegionPool,
        narrower: GradientNarrower,
        blocks: Optional[Dict[str, int]] = None,
        data: Optional[DataLink] = None,
    ):
        self.endpoint = endpoint
        self._identity = identity
        self._config = config
        self.contact = Contact()  # when the pserver last heard from this trainer (trainer/heartbeat.py)
        replicated = len(addresses) > 1
        self._link = ShardLink(
            endpoint, identity, config, open_channel, regions, self.contact, blocks or {}, replicated, data
        )
        self.lanes = self._link.lanes
        self.primary = ShardPrimary(self._link, addresses, identity.trainer_id, config.recovery_timeout)
        self._tensors = TensorCalls(self._link, self.primary, identity, config, narrower, self.contact)

    @property
    def bytes_pushed(self) -> int:
        """Tensor bytes of every push that went through, as sent (narrowed)."""
        return self._tensors.bytes_pushed

    @property
    def data_connections(self) -> int:
        """Data connections open to this pserver now (one per lane used; 0 over gRPC)."""
        data = self._link.data
        return data.connections if data is not None else 0

    @property
    def bytes_pulled(self) -> int:
        """Tensor bytes of every answer received."""
        return self._tensors.bytes_pulled

    # -- session -------------------------------------------------------------

    @property
    def session(self) -> str:
        """The session this trainer's calls carry (empty before Hello)."""
        return self._link.session

    def use_session(self, session: str) -> None:
        """Carry ``session`` from now on: a node's local ranks use the one their leader's Hello opened."""
        self._link.use_session(session)

    def hello(self, deadline: float, timeout: float, join_at: int = 0) -> ps_pb2.HelloReply:
        """Open this trainer's session at the pserver (with hot standby: its shard's primary); its answer.

        Waits for the pserver until ``deadline`` (monotonic), ``timeout`` s in
        all; ``join_at``: see ``Channels.hello``.
        """
        if not self.primary.replicated:
            return self._link.hello_here(deadline, join_at, timeout)
        while True:  # None: another call followed the primary meanwhile; say Hello there too
            reply = self.primary.follow(self.primary.generation, deadline, join_at)
            if reply is not None:
                return reply

    def close(self, deadline: float) -> int:
        """Tell the pserver this trainer is done; the trainers it has left (-1: not told).

        A Close lost to a pserver that died under it (or that is restarting)
        is sent again until ``deadline`` (monotonic): a pserver restarted from
        a checkpoint written before this Close would otherwise wait for this
        trainer, and never finish. A restarted pserver no longer knows this
        trainer's session, so the trainer says Hello to it first.
        """
        tid = self._identity.trainer_id
        while True:
            generation = self.primary.generation
            request = ps_pb2.CloseRequest(trainer_id=tid, session=self._link.session)
            remaining = deadline - time.monotonic()
            # While retrying, each try waits for the pserver a while (and logs), as Hello does.
            timeout = (
                min(remaining, WAIT_LOG_INTERVAL) if remaining > 0 else min(self._config.rpc_timeout, 30.0)
            )
            try:
                # Hot standby: no waiting for a dead primary to come back (its backup leads): UNAVAILABLE at
                # once.
                ready = remaining > 0 and not self.primary.replicated
                return self._link.connection.unary["Close"](
                    request, timeout=timeout, wait_for_ready=ready
                ).trainers_left
            except grpc.RpcError as e:
                code, remaining = e.code(), deadline - time.monotonic()
                if not (remaining > 0 and code in RETRY_CLOSE):
                    log.warning("trainer %d: close at %s failed: %s", tid, self.endpoint, details(e))
                    return -1
                log.info(
                    "trainer %d: close at %s failed (%s); sending it again", tid, self.endpoint, details(e)
                )
                try:
                    if code == grpc.StatusCode.UNAVAILABLE and self.primary.replicated:
                        self.primary.follow(
                            generation, deadline
                        )  # hot standby: the other process may lead now
                    elif code == grpc.StatusCode.ABORTED:  # a restarted pserver: a session first
                        self._link.hello_here(deadline)
                except PserverError as failed:
                    log.warning("trainer %d: close at %s failed: %s", tid, self.endpoint, failed)
                    return -1

    # -- transfers (tensor_calls.py) ------------------------------------------

    def push_pull(
        self,
        step: int,
        tensors: Iterable[Named],
        dtype_and_shape: DtypeAndShape,
        decode_into: DecodeInto,
        position: Tuple[int, int] = (0, 0),
        during_backward: bool = False,
        answer_bytes: Optional[int] = None,
        step_trainers: Sequence[int] = (),
        dropped: bool = False,
    ) -> int:
        """Send one step's gradients and receive the pserver's blocks in the same call; the pserver's step
        (see :meth:`.tensor_calls.TensorCalls.push_pull`)."""
        return self._tensors.push_pull(
            step,
            tensors,
            dtype_and_shape,
            decode_into,
            position,
            during_backward,
            answer_bytes,
            step_trainers,
            dropped,
        )

    def start_push_pull(
        self,
        step: int,
        tensors: Iterable[Named],
        decode_into: DecodeInto,
        position: Tuple[int, int] = (0, 0),
        step_trainers: Sequence[int] = (),
        dropped: bool = False,
    ) -> Optional[StartedPush]:
        """:meth:`push_pull` sent, its answer read by the result's ``finish()``; None where it cannot go so
        (see :meth:`.tensor_calls.TensorCalls.start_push_pull`)."""
        return self._tensors.start_push_pull(step, tensors, decode_into, position, step_trainers, dropped)

    def pull(
        self, names: Sequence[str], min_step: int, dtype_and_shape: DtypeAndShape, decode_into: DecodeInto
    ) -> int:
        """Receive blocks ``names`` once the pserver's step reaches ``min_step`` (see
        :meth:`.tensor_calls.TensorCalls.pull`)."""
        return self._tensors.pull(names, min_step, dtype_and_shape, decode_into)

    def prefetch(
        self, min_step: int, ids: Sequence[Named], dtype_and_shape: DtypeAndShape
    ) -> Dict[str, torch.Tensor]:
        """Send ``ids`` and receive their rows (see :meth:`.tensor_calls.TensorCalls.prefetch`)."""
        return self._tensors.prefetch(min_step, ids, dtype_and_shape)

    # -- control calls ---------------------------------------------------------

    def _unary(self, method: str, request: Callable, what: str, timeout: float):
        """Call ``method`` with ``request(session=...)`` (built by each attempt: a new session after a
        failover)."""
        return self.primary.run(functools.partial(self._unary_once, method, request, what, timeout))

    def _unary_once(self, method: str, request: Callable, what: str, timeout: float):
        try:  # Heartbeat, SaveTables, Restore, Checkpoint, Reduce: all touch on arrival
            with self.contact.call():
                return self._link.connection.unary[method](
                    request(session=self._link.session), timeout=timeout
                )
        except grpc.RpcError as e:
            raise error_of(self.endpoint, f"{what} failed: {details(e)}", e) from None

    def heartbeat(self, timeout: float) -> ps_pb2.HeartbeatReply:
        """Tell the pserver this trainer lives; its answer carries its step and incarnation.

        On the data channel where the pserver has one (:meth:`DataLink.heartbeat`); over gRPC before the
        first Hello named its data port, where the data connection broke (gRPC's call then follows a new
        primary, or says the pserver is down), and where the data port did not answer within a
        ``heartbeat_interval``: its reactor is busy (a long checkpoint written under the engine's lock),
        and gRPC's Heartbeat is noted without that lock. While a data call is in flight none is sent: that
        call is the sign of life (the answer's step -1).
        """
        tid = self._identity.trainer_id
        if self._link.data_ready:
            try:
                with self.contact.call():
                    beat = self._link.data.heartbeat(min(timeout, self._config.heartbeat_interval))
            except grpc.RpcError as e:
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise error_of(
                        self.endpoint, f"heartbeat of trainer {tid} failed: {details(e)}", e
                    ) from None
            else:
                step, incarnation = beat if beat is not None else (-1, 0)
                return ps_pb2.HeartbeatReply(step=step, incarnation=incarnation)
        return self._unary(
            "Heartbeat",
            functools.partial(ps_pb2.HeartbeatRequest, trainer_id=tid),
            f"heartbeat of trainer {tid}",
            timeout,
        )

    def save_tables(self, directory: str) -> ps_pb2.SaveTablesReply:
        """Ask the pserver to write its table shards under ``directory`` (its file system)."""
        request = functools.partial(
            ps_pb2.SaveTablesRequest,
            trainer_id=self._identity.trainer_id,
            directory=directory,
            layout_digest=self._identity.layout_digest,
        )
        return self._unary("SaveTables", request, f"saving tables to {directory!r}", self._config.rpc_timeout)

    def restore(self, step: int, token: str) -> ps_pb2.RestoreReply:
        """Ask the pserver to roll back to its checkpoint at ``step`` (once per ``token``)."""
        tid = self._identity.trainer_id
        request = functools.partial(
            ps_pb2.RestoreRequest,
            trainer_id=tid,
            checkpoint_step=step,
            token=token,
            layout_digest=self._identity.layout_digest,
        )
        return self._unary(
            "Restore", request, f"roll-back to step {step} asked by trainer {tid}", self._config.rpc_timeout
        )

    def checkpoint(self) -> ps_pb2.CheckpointReply:
        """Ask the pserver to write its part of a checkpoint now."""
        tid = self._identity.trainer_id
        request = functools.partial(
            ps_pb2.CheckpointRequest, trainer_id=tid, layout_digest=self._identity.layout_digest
        )
        return self._unary(
            "Checkpoint", request, f"checkpoint asked by trainer {tid}", self._config.rpc_timeout
        )

    def reduce(
        self, key: str, round_: int, op: str, values: Sequence[Tuple[str, Sequence[int], Sequence[float]]]
    ) -> ps_pb2.ReduceReply:
        """Combine ``values`` ([(name, shape, float64 data)]) with every live trainer's for ``(key, round_)``
        (answered once all are in, or refused after the pserver's barrier_timeout naming the missing ones)."""
        tid = self._identity.trainer_id
        request = functools.partial(
            ps_pb2.ReduceRequest,
            trainer_id=tid,
            layout_digest=self._identity.layout_digest,
            key=key,
            round=round_,
            op=op,
            values=[ps_pb2.ReduceValue(name=n, shape=shape, data=data) for n, shape, data in values],
        )
        return self._unary(
            "Reduce",
            request,
            f"round {round_} of reduction {key!r} by trainer {tid}",
            wait_timeout(self._config),
        )

    def claim(self, step: int) -> ps_pb2.ClaimReply:
        """Backup trainers: whether this trainer's push counts in ``step``, and the step's trainers (first
        pserver)."""
        request = functools.partial(
            ps_pb2.ClaimRequest,
            trainer_id=self._identity.trainer_id,
            step=step,
            layout_digest=self._identity.layout_digest,
        )
        return self._unary("Claim", request, f"claim of step {step}", wait_timeout(self._config))

    def stats(self, timeout: float) -> futures.Future:
        """The pserver's counters (``StatsReply``), asked of the process calls go to now: a future.

        No session and no following of the shard's primary (an observer must
        not move the trainer's calls); see :func:`start_unary`.
        """
        return start_unary(
            self._link.connection.unary["Stats"], ps_pb2.StatsRequest(), self.endpoint, "Stats", timeout
        )

    def shutdown(self) -> None:
        """Close the gRPC channels (without telling the pserver); calls still running end CANCELLED."""
        self._link.shutdown()


def start_unary(
    method: grpc.UnaryUnaryMultiCallable, request, endpoint: str, what: str, timeout: float
) -> futures.Future:
    """Send ``request`` by ``method`` with a deadline of ``timeout`` s; return its future at once.

    Its result: the reply, or the :class:`PserverError` saying ``what`` failed (to pserver ``endpoint``).
    For calls a thread sends and reads later (Stats an observer polls, all pservers at once): the gRPC
    call runs on no pool thread, and its failure reaches the reader as the same domain error a blocking
    call raises. gRPC starts a thread to poll a channel that had no such call in flight, each time: not
    for calls sent every interval on many channels (heartbeats go through :meth:`Channels.submit`).
    """
    outcome: futures.Future = futures.Future()

    def ended(call: grpc.Future) -> None:
        try:
            reply = call.result()
        except grpc.RpcError as e:
            error = error_of(endpoint, f"{what} failed: {details(e)}", e)
        except Exception as e:  # noqa: BLE001 - a channel closed under the call: the reader sees why
            error = PserverError(endpoint, f"{what} failed: {e!r}")
        else:
            error = None
        if error is None:
            outcome.set_result(reply)
        else:
            outcome.set_exception(error)

    method.future(request, timeout=timeout).add_done_callback(ended)
    return outcome
