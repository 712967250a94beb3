"""The RPC layer: the one part of the pserver that speaks gRPC.

``service/`` is the ParameterServer service: its servicer checks each request
and calls the engine (or the Reduce service), asking the pserver's
:class:`~pserver.engine.Contents` what a request may carry, one servicer per
concern (data, control, hot standby's calls). ``prologue.py`` holds what every
call goes through (parsing, the caller's checks) and maps the domain errors of
:mod:`pserver.errors` to gRPC status codes; ``sessions.py`` decides which
process speaks for each trainer id; ``counters.py`` counts what the servicer
received, sent and refused; ``buffers.py`` pools the gradient receive buffers;
``mapped_regions.py`` keeps the shared-memory regions of trainers on this host
mapped (PushPullShared); ``lane_pushes.py`` makes a push split across lanes
whole; ``replica_link.py`` is hot standby's client (:mod:`pserver.replication`).
``parking.py`` lets a servicer method that waits (a sync step, ``min_step``,
staleness, a Reduce round) yield its :class:`~pserver.engine.waits.Parked`
handle, and ``aio.py`` drives those methods on gRPC's asyncio server, awaiting
the handle on the event loop instead of holding a thread (``stretches.py``:
where their CPU runs; ``arrival.py``: a call is a sign of life as it arrives);
``main_port.py`` runs that server on the pserver's endpoint, on an event-loop
thread of its own, and stops it in order. ``sessions.py`` also holds the
:class:`~.sessions.Incarnation` trainers tell a pserver's state by.
Nothing below this layer (engines, stores, tables, checkpoints) imports grpc.
:mod:`pserver.server` needs the servicer and the main port (the service's name is
:data:`psproto.wire.SERVICE`).
"""

from .service import PserverServicer

__all__ = ["PserverServicer"]
