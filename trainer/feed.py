"""The data side of a trainer: batches from its data position, read and prepared one batch ahead.

:class:`Feed` backs ``Trainer.batches``. It walks the loader from the data
position the pservers hold for this trainer (a restarted trainer or a job
resumed from a checkpoint skips what was trained), replays the batches since
a checkpoint when the job rolls back, and pipelines: while the current batch
trains, a background thread reads the next one from the loader and prepares
its table ids (deduplicated and routed, see ``TableClient.plan_next_batch``), so
``Trainer.step`` sends them with its push without doing that work itself.
Preparing is a pure function of the ids, so sync training stays exact.
"""

from __future__ import annotations

import itertools
from concurrent import futures
from typing import Callable, Iterable, Iterator, Optional

from transpiler.position import Position

from .steppers.state import StepState

_END = object()  # the loader has no more items this epoch


class Feed:
    """Which batch a trainer trains next, read on a background thread with ``read_ahead``.

    It reads and moves the trainer's data position in ``state`` (a batch
    begins, an epoch ends; ``state.rewound`` makes it start the epoch over
    from ``state.position``). ``pull()`` refreshes the parameters at the end,
    and ``plan_next(ids)`` turns a batch's ``{table: ids}`` into the plan its
    step sends with the push before it (``None``: nothing). ``end_epoch()``
    runs when the loader ran out, the position already at the next epoch.
    """

    def __init__(
        self,
        state: StepState,
        pull: Callable[[], None],
        plan_next: Optional[Callable[[dict], object]],
        read_ahead: bool,
        end_epoch: Callable[[], None] = lambda: None,
    ):
        self._state = state
        self._pull = pull
        self._end_epoch = end_epoch
        self._plan_next = plan_next
        self._reader = (
            futures.ThreadPoolExecutor(1, thread_name_prefix="trainer-feed") if read_ahead else None
        )
        self._next: Optional[futures.Future] = None  # the next (index, item, plan) being read

    def batches(
        self, loader: Iterable, epochs: int, prefetch: Optional[Callable[[object], dict]] = None
    ) -> Iterator:
        """The items of ``loader`` for ``epochs`` epochs from the data position on (see
        ``Trainer.batches``)."""
        try:
            while True:
                yield from self._from_position(loader, epochs, prefetch)
                # The last step's answer held the final parameters; a pserver lost since may have
                # rolled the job back to a checkpoint, whose data is then trained again.
                self._pull()
                if self._state.position[0] >= epochs:
                    return
        finally:
            self._drop_next()
            self._state.end_batches()

    def follow(
        self,
        pull: Callable[[], None],
        plan_next: Optional[Callable[[dict], object]],
        end_epoch: Callable[[], None] = lambda: None,
    ) -> None:
        """Pull, plan and end epochs through the trainer's parts of a new layout (a change of pserver
        count), from the next read on. The plan of the batch read ahead went with the last step's push, to
        the old pservers; that batch's lookups fetch for themselves."""
        self._pull, self._plan_next, self._end_epoch = pull, plan_next, end_epoch

    def take_next_plan(self) -> object:
        """The plan made for the batch after the current one (``None``: none, or no next batch).

        Waits for the background read; a loader error is raised by the
        generator when it reaches that item, not here.
        """
        if self._next is None:
            return None
        try:
            item = self._next.result()
        except Exception:  # noqa: BLE001 - the generator re-raises it where the user iterates
            return None
        return None if item is _END else item[2]

    def close(self) -> None:
        """Stop the background reader (an item being read is finished first)."""
        self._drop_next()
        if self._reader is not None:
            self._reader.shutdown(wait=True)

    def _from_position(self, loader: Iterable, epochs: int, prefetch) -> Iterator:
        while self._state.position[0] < epochs:
            epoch, start = self._state.position
            set_epoch = getattr(getattr(loader, "sampler", None), "set_epoch", None)
            if set_epoch is not None:
                set_epoch(epoch)
            self._state.begin_epoch()
            items = itertools.islice(enumerate(loader), start, None)
            self._read(items, None)  # the first item's lookups fetch for themselves: nothing to plan
            current = self._take()
            while current is not _END:
                i, item, _ = current
                self._read(items, prefetch)  # the next one, while this one trains
                self._state.begin_batch(Position(epoch, i + 1))
                yield item
                if self._state.rewound:
                    break
                current = self._take()
            else:  # the loader ran out: the next epoch starts at its first batch
                self._state.end_epoch(epoch)
                self._end_epoch()  # may re-sync the trainer elsewhere: the loop goes on from there
            self._drop_next()
            self._state.end_batches()

    def _read(self, items: Iterator, prefetch) -> None:
        """Start reading the next item and planning its ``prefetch`` ids (on the reader thread when reading
        ahead)."""

        def read():
            got = next(items, None)
            if got is None:
                return _END
            i, item = got
            plan = None
            if prefetch is not None and self._plan_next is not None:
                plan = self._plan_next(prefetch(item))
            return i, item, plan

        if self._reader is not None:
            self._next = self._reader.submit(read)
        else:
            done: futures.Future = futures.Future()
            try:
                done.set_result(read())
            except BaseException as e:  # noqa: BLE001 - raised where the user iterates, as without a feed
                done.set_exception(e)
            self._next = done

    def _take(self):
        """The item read by the last :meth:`_read` (its loader error raised here)."""
        nxt, self._next = self._next, None
        return nxt.result()

    def _drop_next(self) -> None:
        """Forget a read ahead that will not be trained (a rewind, the end, a loop the user left)."""
        nxt, self._next = self._next, None
        if nxt is not None:
            futures.wait([nxt])
