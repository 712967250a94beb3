"""Servicer methods that may wait: written once, driven either by a blocking caller or by the asyncio server.

A method that waits for a state (a sync step's barrier, ``min_step``, an
async push past ``max_staleness``, a Reduce round) is a generator: it yields a
:class:`~pserver.engine.waits.Parked` handle where it waits, is resumed once
the handle is done, and yields its answers (one for a unary answer, the chunks
of a stream). :func:`parks` makes such a generator a plain servicer method
whose waits block (in-process callers, tests); the asyncio server
(:mod:`.aio`) drives the same generator through ``method.parking``, awaiting
each handle on its event loop without holding a thread.
"""

from __future__ import annotations

import functools
from typing import Iterator, Optional

from ..engine.waits import Parked


def park(handle: Optional[Parked]) -> Iterator[Parked]:
    """``yield from park(h)``: wait for ``h`` (None: no wait), then report it and raise its error, if any."""
    if handle is not None:
        yield handle
        handle.finish()


def _blocking(answers: Iterator) -> Iterator:
    """The answers of a parking generator, each wait blocking this thread until its handle is done."""
    for item in answers:
        if isinstance(item, Parked):
            with item.waits.cv:
                item.waits.block(item)
        else:
            yield item


def parks(stream: bool = False):
    """Make a parking generator (see the module) a servicer method; ``stream``: its answer is a stream.

    The method returned blocks at each wait; its ``parking`` attribute is
    the generator function, and ``streams`` says the answer's shape.
    """

    def wrap(method):
        if stream:

            @functools.wraps(method)
            def blocking(self, request, context):
                yield from _blocking(method(self, request, context))
        else:

            @functools.wraps(method)
            def blocking(self, request, context):
                for answer in _blocking(method(self, request, context)):
                    return answer
                return None

        blocking.parking = method
        blocking.streams = stream
        return blocking

    return wrap
