"""ShardLink: this trainer's link to one pserver's shard: the process its calls go to, and their session.

A pserver's calls go over one :class:`~.connection.Connection` (and its :mod:`.lanes`) to one
process of its shard: the pserver itself, or under hot standby the process that leads. Each call
carries the session that process answered this trainer's Hello with. The link opens that session
(Hello, waiting for the pserver to come up), points the calls at another process of the shard
(:meth:`ShardLink.connect`), and asks any process whether it leads (the Lead call): the calls
:class:`~.primaries.ShardPrimary` follows the primary with.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import grpc

from psproto import ps_pb2
from psproto.wire import method_path
from transpiler import DistributeTranspilerConfig

from ..errors import PserverUnavailableError
from .connection import Connection
from .contact import Contact
from .data.data_link import DataLink
from .lanes import Lanes
from .primaries import MOVED_ON
from .shared_regions import RegionPool
from .status_codes import details, error_of

log = logging.getLogger(__name__)

# How often a waiting trainer says whom it waits for.
WAIT_LOG_INTERVAL = 5.0


@dataclass(frozen=True)
class TrainerIdentity:
    """Who this trainer process is to every pserver: its id, its plan, and this process's incarnation."""

    trainer_id: int
    layout_digest: str
    incarnation: int
    layout_epoch: int = 0


class ShardLink:
    """The process of pserver ``endpoint``'s shard its calls go to now, and the session they carry.

    ``open_channel(address)`` makes a gRPC channel to a process of the shard; ``blocks``: the
    pserver's blocks and their bytes, what a push-pull split across lanes is dealt by;
    ``replicated``: the shard has a backup (hot standby); ``contact``: the pserver's, noted by Hello;
    ``data``: the data connections to it (None: transfers go over gRPC), pointed at the process and
    session each Hello names.
    """

    def __init__(
        self,
        endpoint: str,
        identity: TrainerIdentity,
        config: DistributeTranspilerConfig,
        open_channel: Callable[[str], grpc.Channel],
        regions: RegionPool,
        contact: Contact,
        blocks: Dict[str, int],
        replicated: bool,
        data: Optional[DataLink] = None,
    ):
        self.endpoint = endpoint
        self.address = endpoint  # the process calls go to now (hot standby: the shard's primary)
        self._identity = identity
        self._config = config
        self._open_channel = open_channel
        self._regions = regions
        self._contact = contact
        self._replicated = replicated
        self.data = data
        # What the process answered this trainer process's latest Hello.
        self._session = ""
        self.connection = self._connect_to(endpoint)
        self.lanes = Lanes(
            config.push_lanes, blocks, config.chunk_bytes, lambda: self._connect_to(self.address), endpoint
        )
        self._lead_calls: Dict[str, Tuple[grpc.Channel, Callable]] = {}

    @property
    def data_ready(self) -> bool:
        """Whether calls go over the data channel now (the process calls go to named its data port)."""
        return self.data is not None and self.data.available

    def _connect_to(self, address: str) -> Connection:
        return Connection(self._open_channel(address), self._config.chunk_bytes, self._regions, self.endpoint)

    def connect(self, address: str) -> None:
        """Point every later call at the process at ``address`` (the pserver itself, or its backup)."""
        old, self.connection, self.address = self.connection, self._connect_to(address), address
        old.close()
        self.lanes.reset()
        if self.data is not None:  # until that process's Hello names its data port
            self.data.moved(address, 0, "")

    def lead(self, address: str, timeout: float) -> Optional[Tuple[str, int]]:
        """Ask the process at ``address`` whether it leads its shard: (role, epoch), or None if it did not
        answer; the role :data:`~.primaries.MOVED_ON` for a process of a later layout than this trainer's."""
        call = self._lead_calls.get(address)
        if call is None:
            channel = self._open_channel(address)
            call = self._lead_calls[address] = (
                channel,
                channel.unary_unary(
                    method_path("Lead"),
                    request_serializer=ps_pb2.LeadRequest.SerializeToString,
                    response_deserializer=ps_pb2.LeadReply.FromString,
                ),
            )
        try:
            reply = call[1](ps_pb2.LeadRequest(), timeout=timeout)
        except grpc.RpcError:
            return None
        if reply.layout_epoch > self._identity.layout_epoch:  # the job moved on: its Hello says where
            return MOVED_ON, reply.epoch
        return reply.role, reply.epoch

    @property
    def session(self) -> str:
        """The session this trainer's calls carry (empty before Hello)."""
        return self._session

    def use_session(self, session: str) -> None:
        """Carry ``session`` from now on: a node's local ranks use the one their leader's Hello opened."""
        self._session = session

    def hello_here(
        self, deadline: float, join_at: int = 0, timeout: Optional[float] = None
    ) -> ps_pb2.HelloReply:
        """Hello to the process calls go to now, waiting for it (and for a predecessor's session) until
        ``deadline``.

        ``join_at``: see ``Channels.hello``. ``timeout``: how long the caller waits in all, for the
        error that says so (default: until ``deadline``).
        """
        tid = self._identity.trainer_id
        timeout = max(0.0, deadline - time.monotonic()) if timeout is None else timeout
        request = ps_pb2.HelloRequest(
            trainer_id=tid,
            layout_digest=self._identity.layout_digest,
            incarnation=self._identity.incarnation,
            join_at=join_at,
            layout_epoch=self._identity.layout_epoch,
        )
        next_log, last, id_taken_until = 0.0, "no answer", None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PserverUnavailableError(
                    self.endpoint, f"did not come up within {timeout:g}s (trainer {tid}; last error: {last})"
                )
            if time.monotonic() >= next_log:
                log.info("trainer %d: waiting for %s", tid, self.endpoint)
                next_log = time.monotonic() + WAIT_LOG_INTERVAL
            started = time.monotonic()
            try:
                reply = self.connection.unary["Hello"](
                    request, timeout=min(remaining, WAIT_LOG_INTERVAL), wait_for_ready=True
                )
                log.info("trainer %d: %s is up (step %d)", tid, self.endpoint, reply.start_step)
                self._session = reply.session
                if self.data is not None:
                    self.data.moved(self.address, reply.data_port, reply.session)
                self._contact.noted(started)
                return reply
            except grpc.RpcError as e:
                code = e.code()
                if code == grpc.StatusCode.ALREADY_EXISTS:
                    # Another process holds this id. If it is this trainer's predecessor, killed
                    # moments ago, its session ages out within one alive window; a true duplicate
                    # is still there after it.
                    now = time.monotonic()
                    if id_taken_until is None:
                        id_taken_until = (
                            now + self._config.session_alive_window + self._config.heartbeat_interval
                        )
                    if now >= min(id_taken_until, deadline):
                        raise error_of(self.endpoint, f"refused Hello: {details(e)}", e) from None
                    last = details(e)
                    time.sleep(max(0.0, min(self._config.heartbeat_interval / 4, deadline - now)))
                    continue
                if code == grpc.StatusCode.UNAVAILABLE and self._replicated:
                    # Down, or a replica that does not lead: the caller asks the shard who leads.
                    raise error_of(self.endpoint, f"Hello: {details(e)}", e) from None
                # CANCELLED: a pserver shutting down cancels the calls it holds, a waiting Hello too.
                if code not in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.CANCELLED,
                ):
                    raise error_of(self.endpoint, f"refused Hello: {details(e)}", e) from None
                last = details(e)

    def shutdown(self) -> None:
        """Close every gRPC channel to the shard (without telling the pserver); calls still running end
        CANCELLED."""
        self.connection.close()
        self.lanes.close()
        if self.data is not None:
            self.data.close()
        for channel, _ in self._lead_calls.values():
            channel.close()
