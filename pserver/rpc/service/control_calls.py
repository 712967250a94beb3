"""The control calls of the service: a trainer's session, its orders to the pserver, its rounds with
others.

Hello opens (or keeps) a trainer process's session, Heartbeat and Close keep and end it; Restore,
Checkpoint and SaveTables roll back, checkpoint and save the tables on a trainer's order; Reduce and Claim
wait for the other trainers (a global metric's round, backup trainers' step); Stats answers anyone
(``ps-stat``). Each is a unary call whose request is parsed and checked by
:func:`~pserver.rpc.prologue.trainer_call` (Hello and Stats check their own).
"""

from __future__ import annotations

import logging
import time
from typing import Dict, Optional

import grpc

from psproto import ps_pb2

from ...engine import Engine
from ...engine.services.claims import StepClaims
from ...engine.services.reductions import Reductions, to_values
from ...errors import BadRequest, NotAllowed
from ..counters import Counters
from ..parking import park, parks
from ..prologue import CALLS_LOG, CallerChecks, parse, refusals, trainer_call
from ..sessions import Incarnation, Sessions
from ..stretches import Stretches, answered_on_loop

log = logging.getLogger(CALLS_LOG)


class ControlCalls:
    """Hello / Heartbeat / Close / Restore / Checkpoint / SaveTables / Reduce / Claim / Stats.

    ``sessions`` decide which process speaks for each trainer id; ``incarnation`` is what trainers tell
    this pserver's state by; ``reductions`` the Reduce service; ``claims`` the Claim service (backup
    trainers; None: this pserver does not decide); ``replica`` the process's place in its replicated shard
    (None without replicas); ``stretches`` where parked calls' stretches run (SaveTables keeps them off the
    loop); ``started`` when this pserver started (``time.monotonic()``), for Stats.
    """

    def __init__(
        self,
        engine: Engine,
        checks: CallerChecks,
        counters: Counters,
        sessions: Sessions,
        incarnation: Incarnation,
        reductions: Reductions,
        claims: Optional[StepClaims],
        replica,
        stretches: Stretches,
        started: float,
        data_port: int = 0,
    ):
        self.engine = engine
        self.data_port = data_port  # the data channel's port, named in every HelloReply
        self.checks = checks
        self.counters = counters
        self.sessions = sessions
        self._incarnation = incarnation
        self.reductions = reductions
        self.claims = claims
        self.replica = replica
        self.stretches = stretches
        self.started = started
        self.endpoint = engine.endpoint

    @property
    def incarnation(self) -> int:
        """What trainers tell this pserver's state by (:class:`~pserver.rpc.sessions.Incarnation`)."""
        return self._incarnation.value

    @refusals
    def Hello(self, data, context):
        request = parse(ps_pb2.HelloRequest, data)
        self.checks.trainer(request.trainer_id)
        self.checks.epoch(request.layout_epoch)  # before serving: leading or not, it knows where the job went
        self.checks.serving()
        self.checks.digest(request.layout_digest)
        self.engine.check_hello(request.trainer_id)
        if not request.incarnation:
            raise BadRequest(
                "Hello needs the trainer process's incarnation (a random nonzero number, one a process)"
            )
        if request.join_at < 0:
            raise BadRequest(f"join_at must be >= 0, got {request.join_at}")
        last_heard, ended = self.engine.presence(request.trainer_id)
        session = self.sessions.hello(
            request.trainer_id, request.incarnation, context.peer(), last_heard, ended
        )
        joined = self.engine.hello(request.trainer_id, request.join_at)
        return ps_pb2.HelloReply(
            start_step=joined.step,
            sync_mode=self.engine.sync_mode,
            trainers=self.engine.trainers,
            incarnation=self.incarnation,
            epoch=joined.position[0],
            batch=joined.position[1],
            checkpoint_step=joined.checkpoint_step,
            counted_step=joined.counted_step,
            session=session,
            applied_step=joined.applied_step,
            others_in_step=joined.others_in_step,
            replica_epoch=self.replica.epoch if self.replica is not None else 0,
            data_port=self.data_port,
        )

    @trainer_call(ps_pb2.SaveTablesRequest, touch=True)
    def SaveTables(self, request, context):
        if not request.directory:
            raise BadRequest("SaveTables needs a directory")
        if "\0" in request.directory:
            # The file system would refuse it with a plain ValueError, read as a bug here: checked first.
            raise BadRequest("embedded null byte")
        with self.stretches.off_loop():  # its writes hold the engine's lock: no stretch may wait on the loop
            pserver_step, paths = self.engine.save_tables(request.directory)
        log.info(
            "%s: saved %d table shards after %d updates to %s",
            self.endpoint,
            len(paths),
            pserver_step,
            request.directory,
        )
        return ps_pb2.SaveTablesReply(step=pserver_step, paths=paths)

    @answered_on_loop  # a session check, a counter and a lock-free touch: no pool hop
    @trainer_call(ps_pb2.HeartbeatRequest, digest=False)
    def Heartbeat(self, request, context):
        self.counters.heartbeat(request.trainer_id)
        return ps_pb2.HeartbeatReply(step=self.engine.touch(request.trainer_id), incarnation=self.incarnation)

    @trainer_call(ps_pb2.RestoreRequest, touch=True)
    def Restore(self, request, context):
        if not self.engine.sync_mode:
            raise NotAllowed(
                f"pserver {self.endpoint}: Restore is for sync mode; async pservers resume on their own"
            )
        if request.checkpoint_step < 0 or not request.token:
            raise BadRequest(
                f"Restore needs a checkpoint_step >= 0 and a token, got {request.checkpoint_step} "
                f"{request.token!r}"
            )
        restored = self.engine.restore(request.trainer_id, request.checkpoint_step, request.token)
        return ps_pb2.RestoreReply(step=self.engine.step, restored=restored)

    @trainer_call(ps_pb2.CheckpointRequest, touch=True)
    def Checkpoint(self, request, context):
        step, path = self.engine.checkpoint()
        return ps_pb2.CheckpointReply(checkpoint_step=step, path=path)

    @trainer_call(ps_pb2.CloseRequest, digest=False)
    def Close(self, request, context):
        left = self.engine.close(request.trainer_id)
        self.checks.acked()
        return ps_pb2.CloseReply(trainers_left=left)

    @parks()
    @trainer_call(ps_pb2.ReduceRequest, touch=True)
    def Reduce(self, request, context):
        values = to_values((v.name, v.shape, v.data) for v in request.values)
        handle, result = self.reductions.park(
            request.trainer_id, request.key, request.round, request.op, values
        )
        yield from park(handle)
        combined, trainers = result()
        yield ps_pb2.ReduceReply(
            trainers=trainers,
            values=[
                ps_pb2.ReduceValue(name=name, shape=v.shape, data=v.ravel().tolist())
                for name, v in combined.items()
            ],
        )

    @parks()
    @trainer_call(ps_pb2.ClaimRequest, touch=True)
    def Claim(self, request, context):
        if self.claims is None:
            raise NotAllowed(
                f"pserver {self.endpoint} does not decide which trainers make a step: the first pserver "
                f"does, with backup_trainers set"
            )
        handle, verdict = self.claims.park(request.trainer_id, request.step)
        yield from park(handle)
        v = verdict()
        self.checks.acked()  # hot standby: the backup holds the step's set before any trainer learns it
        yield ps_pb2.ClaimReply(admitted=v.admitted, trainers=v.trainers)

    @refusals
    def Stats(self, data, context):
        parse(ps_pb2.StatsRequest, data)
        replica = self.replica.stats() if self.replica is not None else None
        return self.counters.stats_reply(
            self.endpoint,
            self.engine.stats(),
            self.incarnation,
            time.monotonic() - self.started,
            replica,
            self.checks.layout_epoch,
            self.checks.layout_status(),
        )

    def handlers(self) -> Dict[str, grpc.RpcMethodHandler]:
        """These calls' handlers by method name: raw-bytes requests (parsed here), serialized replies."""
        serialize = lambda m: m.SerializeToString()  # noqa: E731
        return {
            "Hello": grpc.unary_unary_rpc_method_handler(self.Hello, response_serializer=serialize),
            "SaveTables": grpc.unary_unary_rpc_method_handler(self.SaveTables, response_serializer=serialize),
            "Close": grpc.unary_unary_rpc_method_handler(self.Close, response_serializer=serialize),
            "Heartbeat": grpc.unary_unary_rpc_method_handler(self.Heartbeat, response_serializer=serialize),
            "Restore": grpc.unary_unary_rpc_method_handler(self.Restore, response_serializer=serialize),
            "Checkpoint": grpc.unary_unary_rpc_method_handler(self.Checkpoint, response_serializer=serialize),
            "Stats": grpc.unary_unary_rpc_method_handler(self.Stats, response_serializer=serialize),
            "Reduce": grpc.unary_unary_rpc_method_handler(self.Reduce, response_serializer=serialize),
            "Claim": grpc.unary_unary_rpc_method_handler(self.Claim, response_serializer=serialize),
        }
