"""Feed: a trainer's batches from its data position, read and prepared one item ahead.

The Feed is driven here by a stand-in for the trainer (its data position and
a step that moves it), so every case runs with and without reading ahead on
the background thread and must give the same items in the same order.
"""

import threading

import pytest

from trainer.feed import Feed
from trainer.steppers.state import StepState


class Job:
    """The trainer side a Feed talks to: the data position, pulls, and what prepare() saw."""

    def __init__(self, position=(0, 0), ahead=True, prepare=True):
        self.state = StepState(position=position)
        self.pulls = 0
        self.prepared_on = []
        self.feed = Feed(self.state, self.pull, self.prepare if prepare else None, ahead)

    @property
    def position(self):
        return self.state.position

    def pull(self):
        self.pulls += 1

    def prepare(self, ids):
        self.prepared_on.append(threading.current_thread().name)
        return ("prepared", ids)

    def step(self):
        """What Trainer.step does with the data position."""
        self.state.position = self.state.batch_position


class Loader(list):
    """A list whose iteration records the thread of every item read, with a sampler taking set_epoch."""

    def __init__(self, items):
        super().__init__(items)
        self.read_on = []
        self.epochs = []
        self.sampler = self

    def set_epoch(self, epoch):
        self.epochs.append(epoch)

    def __iter__(self):
        for item in list.__iter__(self):
            self.read_on.append(threading.current_thread().name)
            yield item


@pytest.mark.parametrize("ahead", [True, False])
@pytest.mark.parametrize(
    "start, epochs, expected",
    [
        ((0, 0), 1, [(0, "a"), (0, "b"), (0, "c")]),
        ((0, 2), 1, [(0, "c")]),
        ((0, 1), 2, [(0, "b"), (0, "c"), (1, "a"), (1, "b"), (1, "c")]),
        ((1, 0), 2, [(1, "a"), (1, "b"), (1, "c")]),
        ((0, 3), 2, [(1, "a"), (1, "b"), (1, "c")]),  # an epoch stopped after its last batch
        ((2, 0), 2, []),  # a job already done
    ],
)
def test_items_from_the_data_position_on(start, epochs, expected, ahead):
    job = Job(start, ahead)
    loader = Loader("abc")
    got = []
    for item in job.feed.batches(loader, epochs):
        got.append((job.state.batch_position[0], item))
        job.step()
    job.feed.close()
    assert got == expected
    assert job.position == (epochs, 0)
    assert job.pulls == 1  # the final parameters, once
    assert loader.epochs == sorted({e for e, _ in expected} | ({start[0]} if start[0] < epochs else set()))


def test_reading_ahead_reads_and_prepares_the_next_item_on_the_feed_thread():
    job = Job(ahead=True)
    loader = Loader([10, 11, 12])
    seen = []
    for item in job.feed.batches(loader, 1, prefetch=lambda b: {"t": b}):
        seen.append((item, job.feed.take_next_plan()))  # what this step sends ahead: the next item's ids
        job.step()
    job.feed.close()
    assert seen == [(10, ("prepared", {"t": 11})), (11, ("prepared", {"t": 12})), (12, None)]
    assert set(loader.read_on) == {n for n in loader.read_on if n.startswith("trainer-feed")} != set()
    assert job.prepared_on and all(n.startswith("trainer-feed") for n in job.prepared_on)


def test_without_reading_ahead_everything_runs_on_the_callers_thread():
    job = Job(ahead=False)
    loader = Loader([10, 11])
    seen = []
    for item in job.feed.batches(loader, 1, prefetch=lambda b: {"t": b}):
        seen.append((item, job.feed.take_next_plan()))
        job.step()
    assert seen == [(10, ("prepared", {"t": 11})), (11, None)]
    me = threading.current_thread().name
    assert set(loader.read_on) == {me} and set(job.prepared_on) == {me}


@pytest.mark.parametrize("ahead", [True, False])
def test_a_rewind_replays_from_the_position_the_job_moved_to(ahead):
    job = Job(ahead=ahead)
    got = []
    for item in job.feed.batches(Loader("abcd"), 1):
        got.append(item)
        job.step()
        if item == "c" and got.count("c") == 1:  # a roll-back to the checkpoint after "a"
            job.state.position, job.state.rewound = (0, 1), True
    job.feed.close()
    assert got == ["a", "b", "c", "b", "c", "d"]
    assert job.position == (1, 0)


@pytest.mark.parametrize("ahead", [True, False])
def test_a_loader_error_reaches_the_loop_at_its_item(ahead):
    def broken():
        yield "a"
        raise OSError("disk gone")

    class Broken:
        def __iter__(self):
            return broken()

    job = Job(ahead=ahead)
    got = []
    with pytest.raises(OSError, match="disk gone"):
        for item in job.feed.batches(Broken(), 1):
            got.append(item)
            job.step()
    job.feed.close()
    assert got == ["a"] and job.position == (0, 1)


def test_leaving_the_loop_early_finishes_the_read_ahead_and_close_stops_the_thread():
    job = Job(ahead=True)
    loader = Loader(range(100))
    for item in job.feed.batches(loader, 1):
        job.step()
        if item == 3:
            break
    assert len(loader.read_on) == 5  # items 0-3 trained, 4 read ahead, nothing more
    assert job.position == (0, 4) and job.state.batch_position is None
    job.feed.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("trainer-feed")]
