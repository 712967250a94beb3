"""The servicer on gRPC's asyncio server: parked calls hold no thread, CPU work runs in a bounded pool.

The server runs on one event-loop thread. A servicer method that never waits
for other trainers stays synchronous: gRPC runs it in the server's pool (its
``migration_thread_pool``), as the threaded server did. A method written to
park (:mod:`.parking`) gets an asyncio handler from :meth:`Parking.adapt`: its
request stream is collected on the loop, then its generator runs in the same
pool up to its next wait, and the pool thread goes back to the pool. The
thread that ends the wait (the one whose push applied the step, under the
engine's lock) queues the rest of the call (reading and encoding the answer)
to the pool at once; the loop awaits only the answers, and keeps each wait's
deadline (its expiry runs in the pool). A parked call whose client goes away
(cancel, deadline) forgets its handle and closes its generator, which
releases what it held.

Statuses are still chosen by :mod:`.prologue` only: a method running in the
pool sees a :class:`PoolContext`, whose ``abort(code, details)`` raises
:class:`Abort`, answered on the loop with ``await context.abort``.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import Executor, Future, InvalidStateError
from typing import Callable, Dict, Optional

import grpc

from ..engine.waits import Parked
from .arrival import CallsInProgress

_END, _ANSWER = range(2)


class Abort(grpc.RpcError):
    """A servicer method running in the pool aborted its call: ``code``, ``details`` (answered on the loop).

    An ``RpcError``: :func:`~.prologue.refusals` passes it through untouched.
    """

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class PoolContext:
    """What a servicer method running in the pool sees of its asyncio call: its peer, and abort."""

    def __init__(self, context: grpc.aio.ServicerContext):
        self._context = context

    def peer(self) -> str:
        """The client's address, as gRPC gives it."""
        return self._context.peer()

    def invocation_metadata(self):
        """The call's metadata."""
        return self._context.invocation_metadata()

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        """End the call with ``code`` and ``details``: raises :class:`Abort`, which the loop answers."""
        raise Abort(code, details)


class _Call:
    """One parking call's generator, advanced in the pool; the loop awaits only its answers.

    When a wait ends, the thread that ended it (the one that applied the
    step) queues the generator's next stretch to the pool at once: the
    answer is read and encoded without a detour through the event loop. The
    loop hears of a park only to arm its deadline (:meth:`Parking.drive`).
    """

    def __init__(self, pool: Executor, answers, loop: asyncio.AbstractEventLoop,
                 on_park: Callable[[Parked], None]):
        self.pool, self.answers, self.loop, self.on_park = pool, answers, loop, on_park
        self.next: Future = Future()
        self.parked: Optional[Parked] = None
        self.abandoned = False

    def start(self) -> Future:
        """Run the generator to its next answer (or its end) in the pool; the future of that outcome."""
        self.next = Future()
        self.pool.submit(self._advance)
        return self.next

    def _advance(self) -> None:
        if self.abandoned:  # the client went away while this stretch was queued
            self.answers.close()
            return
        try:
            for item in self.answers:
                if not isinstance(item, Parked):
                    self._deliver((_ANSWER, item))
                    return
                if not item.done:
                    self.parked = item
                    self.loop.call_soon_threadsafe(self.on_park, item)
                    item.on_done(self._resume)  # under the engine's lock: at once if it ended meanwhile
                    if self.abandoned:  # gone while this ran: abandon() saw no wait to forget
                        item.cancel()
                    return
        except BaseException as e:  # noqa: BLE001 - the loop answers it (Abort) or gRPC does
            self._deliver(error=e)
            return
        self._deliver((_END, None))

    def _deliver(self, outcome=None, error: Optional[BaseException] = None) -> None:
        if self.next.cancelled():  # the loop stopped waiting (the client went away)
            self.answers.close()
            return
        try:
            if error is not None:
                self.next.set_exception(error)
            else:
                self.next.set_result(outcome)
        except InvalidStateError:  # cancelled just now
            self.answers.close()

    def _resume(self, _handle: Parked) -> None:
        # Called by the thread that ended the wait, under the engine's lock: queue, never run, here.
        try:
            self.pool.submit(self._advance)
        except RuntimeError:  # the pool is shut down: the server stops, nobody reads the answer
            self.answers.close()

    def abandon(self) -> None:
        """The client went away: forget the parked wait (in the pool: that takes the engine's lock)."""
        self.abandoned = True
        parked = self.parked
        if parked is not None and not parked.done:
            try:
                self.pool.submit(parked.cancel)  # ends it: _resume then closes the generator
            except RuntimeError:
                pass


class Parking:
    """Builds the asyncio handlers of the parking servicer methods; CPU work goes to ``pool``.

    ``calls`` (if given) counts each call in progress, from its start to its answer's end.
    """

    def __init__(self, pool: Executor, calls: Optional[CallsInProgress] = None):
        self.pool = pool
        self.calls = calls

    def _serving(self, context):
        return self.calls.serving(context.invocation_metadata()) if self.calls else contextlib.nullcontext()

    def adapt(self, handlers: Dict[str, grpc.RpcMethodHandler]) -> Dict[str, grpc.RpcMethodHandler]:
        """``handlers`` with each parking method's behaviour replaced by an asyncio one (others kept)."""
        return {name: self._adapt(h) for name, h in handlers.items()}

    def _adapt(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        behaviour = (handler.unary_unary or handler.unary_stream or handler.stream_unary
                     or handler.stream_stream)
        parking = getattr(behaviour, "parking", None)
        if parking is None:
            return handler
        servicer, collect = behaviour.__self__, handler.request_streaming

        async def answers(request, context):
            if collect:
                request = iter([m async for m in request])
            return parking(servicer, request, PoolContext(context))

        serializers = dict(request_deserializer=handler.request_deserializer,
                           response_serializer=handler.response_serializer)
        if behaviour.streams:
            async def streamed(request, context):
                with self._serving(context):
                    try:
                        async for answer in self.drive(await answers(request, context)):
                            yield answer
                    except Abort as e:
                        await context.abort(e.code, e.details)
            make = grpc.stream_stream_rpc_method_handler if collect else grpc.unary_stream_rpc_method_handler
            return make(streamed, **serializers)

        async def unary(request, context):
            with self._serving(context):
                driven = self.drive(await answers(request, context))
                try:
                    return await driven.__anext__()  # a unary answer: the generator's one
                except Abort as e:
                    await context.abort(e.code, e.details)
                finally:
                    await driven.aclose()
        make = grpc.stream_unary_rpc_method_handler if collect else grpc.unary_unary_rpc_method_handler
        return make(unary, **serializers)

    async def drive(self, answers):
        """The answers of a parking generator: its stretches run in the pool, each wait's deadline kept here."""
        loop = asyncio.get_running_loop()
        timers = []

        def on_park(handle: Parked) -> None:
            timers.append(loop.call_at(loop.time() + max(0.0, handle.deadline - time.monotonic()),
                                       self._expire, handle))

        call = _Call(self.pool, answers, loop, on_park)
        try:
            while True:
                kind, item = await asyncio.wrap_future(call.start())
                if kind == _END:
                    return
                yield item
        except asyncio.CancelledError:
            call.abandon()
            raise
        finally:
            for timer in timers:
                timer.cancel()

    def _expire(self, handle: Parked) -> None:
        # The deadline passed: expiring takes the engine's lock, so in the pool, never on the loop.
        if not handle.done:
            try:
                self.pool.submit(handle.expire)
            except RuntimeError:  # the pool is shut down: the server's stop ended every wait
                pass
