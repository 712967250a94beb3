"""The servicer on gRPC's asyncio server: parked calls hold no thread, CPU work runs on the loop or in a
bounded pool.

The server runs on one event-loop thread. A servicer method that never waits for other trainers stays
synchronous and runs in the server's pool, as on the threaded server; a unary one (Hello, Restore, ...) is
sent there from an asyncio handler of :meth:`Parking.adapt` rather than by gRPC, so that its call counts as
in progress while it waits for a pool thread (behind a thousand async pushes, that can be longer than
``heartbeat_timeout``: the trainer is not silent). One that only touches memory (a heartbeat,
:func:`~.stretches.answered_on_loop`) runs on the loop itself. A method written to park (:mod:`.parking`)
gets an asyncio handler from :meth:`Parking.adapt`: its request stream is collected on the loop, then its
generator runs up to its next wait (a stretch), and the thread goes back to what it did. A stretch runs on
the loop itself where nothing in a stretch can block (:mod:`.stretches`: no thread hop), in the same pool
otherwise. The thread that ends the wait (the one whose push applied the step, under the engine's lock)
queues the rest of the call (reading and encoding the answer) at once, to the pool or to the loop; the loop
awaits only the answers, and keeps each wait's deadline (its expiry runs in the pool). A parked call whose
client goes away (cancel, deadline) forgets its handle and closes its generator, which releases what it
held.

Statuses are still chosen by :mod:`.prologue` only: a parking method (on the loop or in the pool) sees a
:class:`PoolContext`, whose ``abort(code, details)`` raises :class:`Abort`, answered on the loop with
``await context.abort``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import Executor
from typing import Callable, Dict, Optional

import grpc

from ..engine.waits import Parked
from .arrival import CallsInProgress
from .stretches import Stretches

_END, _ANSWER = range(2)


class Abort(grpc.RpcError):
    """A servicer method running in the pool aborted its call: ``code``, ``details`` (answered on the loop).

    An ``RpcError``: :func:`~.prologue.refusals` passes it through untouched.
    """

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class PoolContext:
    """What a servicer method adapted here (on the loop or in the pool) sees of its asyncio call: peer,
    abort."""

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
    """One parking call's generator, advanced in stretches; the loop awaits only its answers.

    A stretch runs on the loop when :class:`~.stretches.Stretches` allows it
    at its start, in the pool otherwise. When a wait ends, the thread that
    ended it (the one that applied the step, under the engine's lock) queues
    the next stretch at once, never runs it: to the pool (the answer is read
    and encoded without a detour through the loop), or, where stretches run
    on the loop, to the loop (``call_soon`` from the loop's own thread, which
    may be inside another call's stretch: no stretch ever runs inside
    another). The loop hears of a park to arm its deadline (:meth:`Parking.drive`).
    """

    def __init__(
        self,
        pool: Executor,
        answers,
        loop: asyncio.AbstractEventLoop,
        on_park: Callable[[Parked], None],
        stretches: Stretches,
    ):
        self.pool, self.answers, self.loop, self.on_park = pool, answers, loop, on_park
        self.stretches = stretches
        self.next: Optional[asyncio.Future] = None
        self.parked: Optional[Parked] = None
        self.abandoned = False

    def start(self) -> asyncio.Future:
        """On the loop: run the generator to its next answer (or its end); the future of that outcome."""
        self.next = self.loop.create_future()
        self._stretch()
        return self.next

    def _stretch(self) -> None:
        # On the loop: the next stretch, here if it may run on the loop now, else in the pool.
        if self.stretches.on_loop():
            self._advance()
        else:
            self._to_pool()

    def _to_pool(self) -> None:
        try:
            self.pool.submit(self._advance)
        except RuntimeError as e:  # the pool is shut down: the server stops; the call ends with the error
            self.answers.close()
            self._deliver(error=e)

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
                    self._on_loop(self.on_park, item)
                    item.on_done(self._resume)  # under the engine's lock: at once if it ended meanwhile
                    if self.abandoned:  # gone while this ran: abandon() saw no wait to forget
                        item.cancel()
                    return
        except BaseException as e:  # noqa: BLE001 - the loop answers it (Abort) or gRPC does
            self._deliver(error=e)
            return
        self._deliver((_END, None))

    def _on_loop(self, fn, *args) -> None:
        """``fn(*args)`` on the loop: here if this is the loop's thread, else queued to it."""
        if self.stretches.in_loop_thread():
            fn(*args)
        else:
            self._queue(fn, *args)

    def _queue(self, fn, *args) -> None:
        """Queue ``fn(*args)`` to the loop from any thread, the loop's own too; never run it here."""
        try:
            if self.stretches.in_loop_thread():
                self.loop.call_soon(fn, *args)
            else:
                self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the server stopped, nobody reads the answer
            self.answers.close()

    def _deliver(self, outcome=None, error: Optional[BaseException] = None) -> None:
        self._on_loop(self._settle, outcome, error)

    def _settle(self, outcome, error: Optional[BaseException]) -> None:
        if self.next.done():  # the loop stopped waiting (the client went away)
            self.answers.close()
        elif error is not None:
            self.next.set_exception(error)
        else:
            self.next.set_result(outcome)

    def _resume(self, _handle: Parked) -> None:
        # Called by the thread that ended the wait, under the engine's lock: queue, never run, here.
        if self.stretches.allowed:
            self._queue(self._stretch)
        else:
            self._to_pool()

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

    ``stretches`` (default: never on the loop) says where each stretch of a
    parked call runs (:mod:`.stretches`); ``calls`` (if given) counts each
    call in progress, from its start to its answer's end: a parking call's,
    and a synchronous unary method's, which then runs in ``pool`` from here.
    """

    def __init__(
        self, pool: Executor, stretches: Optional[Stretches] = None, calls: Optional[CallsInProgress] = None
    ):
        self.pool = pool
        self.stretches = stretches if stretches is not None else Stretches(allowed=False)
        self.calls = calls

    def _serving(self, context):
        return self.calls.serving(context.invocation_metadata()) if self.calls else contextlib.nullcontext()

    def adapt(self, handlers: Dict[str, grpc.RpcMethodHandler]) -> Dict[str, grpc.RpcMethodHandler]:
        """``handlers`` with each parking method's behaviour replaced by an asyncio one (others kept)."""
        return {name: self._adapt(h) for name, h in handlers.items()}

    def _adapt(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        behaviour = (
            handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
        )
        parking = getattr(behaviour, "parking", None)
        serializers = dict(
            request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )
        if parking is None:
            if handler.unary_unary is None:
                return handler
            on_loop = getattr(behaviour, "answered_on_loop", False)
            if not on_loop and self.calls is None:
                return handler
            return grpc.unary_unary_rpc_method_handler(
                self._unary(handler.unary_unary, on_loop), **serializers
            )
        servicer, collect = behaviour.__self__, handler.request_streaming

        async def answers(request, context):
            if collect:
                request = iter([m async for m in request])
            return parking(servicer, request, PoolContext(context))

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

    def _unary(self, behaviour: Callable, on_loop: bool):
        """``behaviour`` (synchronous, unary) run on the loop (``on_loop``) or in the pool, its call in
        progress meanwhile.

        In the pool, the call counts from its start here: a call cancelled while it waits for a pool thread
        never runs, and stops counting with the cancellation.
        """

        async def unary(request, context):
            with self._serving(context):
                try:
                    if on_loop:
                        return behaviour(request, PoolContext(context))
                    return await asyncio.get_running_loop().run_in_executor(
                        self.pool, behaviour, request, PoolContext(context)
                    )
                except Abort as e:
                    await context.abort(e.code, e.details)

        return unary

    async def drive(self, answers):
        """A parking generator's answers: its stretches run on the loop or in the pool; its waits'
        deadlines here."""
        loop = asyncio.get_running_loop()
        timers = []

        def on_park(handle: Parked) -> None:
            timers.append(
                loop.call_at(loop.time() + max(0.0, handle.deadline - time.monotonic()), self._expire, handle)
            )

        call = _Call(self.pool, answers, loop, on_park, self.stretches)
        try:
            while True:
                kind, item = await call.start()
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
