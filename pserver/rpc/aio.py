"""The servicer on gRPC's asyncio server: parked calls hold no thread, CPU work runs in a bounded pool.

The server runs on one event-loop thread. A servicer method that never waits
for other trainers stays synchronous: gRPC runs it in the server's pool (its
``migration_thread_pool``), as the threaded server did. A method written to
park (:mod:`.parking`) gets an asyncio handler from :meth:`Parking.adapt`: its
request stream is collected on the loop, then its generator runs in the same
pool up to its next wait; the handle of that wait is awaited on the loop (the
thread that applies the step wakes it with ``call_soon_threadsafe``), and the
rest of the call (reading and encoding the answer) runs in the pool again.
A parked call whose client goes away (cancel, deadline) forgets its handle
and closes its generator, which releases what it held.

Statuses are still chosen by :mod:`.prologue` only: a method running in the
pool sees a :class:`PoolContext`, whose ``abort(code, details)`` raises
:class:`Abort`, answered on the loop with ``await context.abort``.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor, Future
from typing import Callable, Dict

import grpc

from ..engine.waits import Parked

_END, _PARK, _ANSWER = range(3)


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


def _advance(answers, wake: Callable[[Parked], None]):
    """In the pool: run ``answers`` to its next answer, its end, or a wait not over yet (``wake`` registered)."""
    for item in answers:
        if not isinstance(item, Parked):
            return _ANSWER, item
        if not item.done:
            item.on_done(wake)  # under the engine's lock: called at once if it ended meanwhile
            return _PARK, item
    return _END, None


def _abandon(answers, step: Future) -> None:
    """The client went away after ``step`` (an :func:`_advance`): forget its wait, close the generator.

    Closing runs the method's ``finally`` clauses (receive buffers go back to their pool).
    """
    if not step.cancelled() and step.exception() is None:
        kind, item = step.result()
        if kind == _PARK:
            item.cancel()
    answers.close()


class Parking:
    """Builds the asyncio handlers of the parking servicer methods; CPU work goes to ``pool``."""

    def __init__(self, pool: Executor):
        self.pool = pool

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
                try:
                    async for answer in self.drive(await answers(request, context)):
                        yield answer
                except Abort as e:
                    await context.abort(e.code, e.details)
            make = grpc.stream_stream_rpc_method_handler if collect else grpc.unary_stream_rpc_method_handler
            return make(streamed, **serializers)

        async def unary(request, context):
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
        """The answers of a parking generator: its steps in the pool, its waits awaited here."""
        loop = asyncio.get_running_loop()
        while True:
            woken = loop.create_future()

            def wake(_handle, woken=woken):
                loop.call_soon_threadsafe(_settle, woken)

            step = self.pool.submit(_advance, answers, wake)
            try:
                kind, item = await asyncio.wrap_future(step)
                if kind == _END:
                    return
                if kind == _ANSWER:
                    yield item
                    continue
                await self._wait(item, woken, loop)
            except asyncio.CancelledError:
                step.add_done_callback(lambda done: self._abandon(answers, done))
                raise

    def _abandon(self, answers, step: Future) -> None:
        # In the pool: forgetting the handle takes the engine's lock, which the loop must not wait for.
        try:
            self.pool.submit(_abandon, answers, step)
        except RuntimeError:  # the pool is shut down (the server stops): nothing waits any more
            _abandon(answers, step)

    async def _wait(self, handle: Parked, woken: asyncio.Future, loop) -> None:
        """Until ``handle`` is done; past its deadline it is expired (in the pool: that takes the engine's lock)."""
        try:
            await asyncio.wait_for(woken, max(0.0, handle.deadline - time.monotonic()))
        except asyncio.TimeoutError:
            await loop.run_in_executor(self.pool, handle.expire)


def _settle(woken: asyncio.Future) -> None:
    if not woken.done():
        woken.set_result(None)
