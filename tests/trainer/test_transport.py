"""The trainer's transport decisions, table-tested: which way a call goes, and how a step's push goes out.

``choose_path`` picks the wire path of every push-pull and prefetch; a step's
push (:class:`StepPush`) goes to every pserver it names through
``Transfers.push_all``, and ``Stepper.push`` is the one healed way there.
"""

import os
import time
from types import SimpleNamespace

import pytest
import torch

from psproto.codec import ONE_MESSAGE_BYTES
from trainer.errors import DOWN, PserverError
from trainer.steppers.stepper import Stepper
from trainer.steppers.transfers import BlocksAndNextRows, StepPush, Transfers
from trainer.transport.wire_paths import (
    ANSWER_STREAMS,
    DURING_BACKWARD,
    ONE_MESSAGE,
    SHARED_MEMORY,
    STREAM,
    BackwardTensors,
    choose_path,
)
from transpiler.position import Position

SMALL, BIG = 1000, ONE_MESSAGE_BYTES + 1


@pytest.mark.parametrize(
    "request_bytes, answer_bytes, shared_memory, during_backward, way",
    [
        # Tensors that stream in during backward: always the stream opened for them.
        (0, None, False, True, DURING_BACKWARD),
        (0, None, True, True, DURING_BACKWARD),
        # An answer of unknown size cannot be one message nor a region: the call streams.
        (SMALL, None, False, False, STREAM),
        (SMALL, None, True, False, STREAM),
        # A pserver that maps this process's memory: shared memory, whatever the sizes.
        (SMALL, SMALL, True, False, SHARED_MEMORY),
        (BIG, BIG, True, False, SHARED_MEMORY),
        # gRPC: one message each way when both fit, else a stream.
        (SMALL, SMALL, False, False, ONE_MESSAGE),
        (ONE_MESSAGE_BYTES, ONE_MESSAGE_BYTES, False, False, ONE_MESSAGE),
        (BIG, SMALL, False, False, STREAM),
        (SMALL, BIG, False, False, STREAM),
        # A prefetch: its answer streams whatever its size, so only the request must fit.
        (SMALL, ANSWER_STREAMS, False, False, ONE_MESSAGE),
        (BIG, ANSWER_STREAMS, False, False, STREAM),
    ],
)
def test_the_wire_path_of_a_call(request_bytes, answer_bytes, shared_memory, during_backward, way):
    assert choose_path(request_bytes, answer_bytes, shared_memory, during_backward) == way


def test_tensors_streamed_during_backward_are_replayed_whole_by_a_resend_and_counted_anew():
    produced = iter([("a", torch.ones(2)), ("b", torch.ones(3))])
    narrowed = []
    tensors = BackwardTensors(
        produced, lambda items: (narrowed.append(name) or (name, t) for name, t in items)
    )
    first = tensors.replay()
    assert next(first)[0] == "a" and tensors.nbytes == 2 * 4  # a send cut off after its first tensor
    assert [name for name, _ in tensors.replay()] == ["a", "b"]  # the resend: the first again, then the rest
    assert tensors.nbytes == 5 * 4 and narrowed == ["a", "a", "b"]


class ScriptedChannels:
    """Each pserver's push-pull records what it was sent; ``failing`` pservers fail their next one.

    Pushes to ``started`` pservers go as over open data connections (``start_push_pull``: sent, the answer
    read by ``finish``); ``events`` records each send, read and abandon in order. Their answers arrive in
    the order ``arrives`` names (default: sorted): the first once every push was sent, each next one once
    the one before was read.
    """

    def __init__(self, failing=(), started=(), arrives=None):
        self.sent, self.failing, self.started, self.events = [], set(failing), set(started), []
        self.arrives = list(arrives if arrives is not None else sorted(started))
        self.pipes = {}

    def close(self):
        for ends in self.pipes.values():
            for end in ends:
                os.close(end)

    def _arrive_next(self):
        if self.arrives:
            os.write(self.pipes[self.arrives.pop(0)][1], b"x")

    def __getitem__(self, endpoint):
        return SimpleNamespace(
            push_pull=lambda *args, **kwargs: self._push_pull(endpoint, *args, **kwargs),
            start_push_pull=lambda *args: self._start(endpoint, *args),
        )

    def _start(self, endpoint, step, tensors, decode_into, position, step_trainers, dropped):
        if endpoint not in self.started:
            return None  # no data connection open: push_pull takes it
        self.events.append(("send", endpoint))
        names = [name for name, _ in tensors]
        self.pipes[endpoint] = os.pipe()
        if len(self.pipes) == len(self.started):
            self._arrive_next()

        def finish():
            self.events.append(("read", endpoint))
            self._arrive_next()
            self.sent.append((endpoint, step, names, position, type(decode_into).__name__, "started"))
            if endpoint in self.failing:
                self.failing.discard(endpoint)
                raise PserverError(endpoint, "FAILED_PRECONDITION: refused", "refused")
            return 1

        return SimpleNamespace(
            finish=finish,
            abandon=lambda: self.events.append(("abandon", endpoint)),
            fileno=lambda: self.pipes[endpoint][0],
            buffered=lambda: False,
            deadline=time.monotonic() + 60.0,
        )

    def _push_pull(
        self,
        endpoint,
        step,
        tensors,
        dtype_and_shape,
        decode_into,
        position,
        during_backward,
        answer_bytes,
        step_trainers=(),
        dropped=False,
    ):
        assert (step_trainers, dropped) == ((), False)  # backup trainers' fields: none in these plain steps
        self.sent.append(
            (
                endpoint,
                step,
                [name for name, _ in tensors],
                position,
                type(decode_into).__name__,
                answer_bytes,
            )
        )
        if endpoint in self.failing:
            self.failing.discard(endpoint)
            raise PserverError(endpoint, "UNAVAILABLE: gone", DOWN)
        return 1

    def run_parallel(self, jobs):
        return {ep: job() for ep, job in jobs.items()}


@pytest.fixture
def scripted():
    """:class:`ScriptedChannels` made with these arguments, their pipes closed after the test."""
    made = []
    yield lambda **kwargs: made.append(ScriptedChannels(**kwargs)) or made[-1]
    for channels in made:
        channels.close()


BLOCKS = SimpleNamespace(answer_bytes={"a": 400, "b": 80}, dtype_and_shape=lambda name: None)


def stage(name):
    return torch.empty(0)


@pytest.mark.parametrize(
    "next_rows, expected",
    [
        # No rows asked ahead: blocks land where the push says; the answer holds the blocks alone.
        ({}, [("a", 7, ["g"], (0, 8), "function", 400), ("b", 7, [], (0, 8), "function", 80)]),
        # The next batch's rows asked of a: its answer holds them too, and lands them beside the blocks;
        # b is asked nothing but still gets a landing for rows (a streamed push may learn of some late).
        (
            {"a": {}, "b": {}},
            [
                ("a", 7, ["g", "t@next"], (0, 8), "BlocksAndNextRows", 400 + 3 * 4 * 4),
                ("b", 7, [], (0, 8), "BlocksAndNextRows", 80),
            ],
        ),
    ],
)
def test_a_step_push_goes_to_every_pserver_it_names_even_with_nothing_for_one(next_rows, expected):
    channels = ScriptedChannels()
    next_ids = {"a": [("t@next", torch.arange(3))]} if next_rows else {}
    push = StepPush(
        7,
        Position(0, 8),
        {"a": [("g", torch.ones(1))] + next_ids.get("a", []), "b": []},
        SimpleNamespace(ids=next_ids, rows={"a": {"t@rows": ("float32", [3, 4])}}) if next_rows else None,
        next_rows,
        blocks_into=stage,
    )
    Transfers(channels, BLOCKS).push_all(push)
    assert sorted(channels.sent) == expected


def test_pushes_over_open_data_connections_are_all_sent_before_any_answer_is_read(scripted):
    channels = scripted(started={"a", "b"})
    push = StepPush(
        7, Position(0, 8), {"a": [("g", torch.ones(1))], "b": [("h", torch.ones(1))]}, blocks_into=stage
    )
    assert Transfers(channels, BLOCKS).push_all(push) == {"a": 1, "b": 1}
    assert [e[0] for e in channels.events] == ["send", "send", "read", "read"]
    assert sorted(channels.sent) == [
        ("a", 7, ["g"], (0, 8), "function", "started"),
        ("b", 7, ["h"], (0, 8), "function", "started"),
    ]


@pytest.mark.parametrize("arrives", [["a", "b", "c"], ["c", "a", "b"], ["b", "c", "a"]])
def test_started_pushes_answers_are_read_in_the_order_they_arrive(arrives, scripted):
    # An answer left unread while another pserver parks the step would be silence to its pserver.
    channels = scripted(started={"a", "b", "c"}, arrives=arrives)
    push = StepPush(
        7,
        Position(0, 8),
        {ep: [(ep + "g", torch.ones(1))] for ep in "abc"},
        blocks_into=stage,
    )
    assert Transfers(channels, BLOCKS).push_all(push) == {"a": 1, "b": 1, "c": 1}
    assert channels.events == [("send", ep) for ep in "abc"] + [("read", ep) for ep in arrives]


def test_a_push_without_an_open_data_connection_goes_as_a_whole_call_beside_the_started_ones(scripted):
    channels = scripted(started={"a"})
    push = StepPush(
        7, Position(0, 8), {"a": [("g", torch.ones(1))], "b": [("h", torch.ones(1))]}, blocks_into=stage
    )
    assert Transfers(channels, BLOCKS).push_all(push) == {"a": 1, "b": 1}
    assert sorted(channels.sent) == [
        ("a", 7, ["g"], (0, 8), "function", "started"),
        ("b", 7, ["h"], (0, 8), "function", 80),
    ]


@pytest.mark.parametrize("failing", ["a", "b"])
def test_a_failed_answer_is_raised_once_every_other_push_ended(failing, scripted):
    channels = scripted(failing={failing}, started={"a", "b"})
    push = StepPush(
        7, Position(0, 8), {"a": [("g", torch.ones(1))], "b": [("h", torch.ones(1))]}, blocks_into=stage
    )
    with pytest.raises(PserverError, match="refused") as raised:
        Transfers(channels, BLOCKS).push_all(push)
    assert raised.value.endpoint == failing
    assert sorted(channels.events) == [("read", "a"), ("read", "b"), ("send", "a"), ("send", "b")]


def test_an_interrupted_push_closes_the_connections_of_the_answers_left_unread(scripted):
    channels = scripted(started={"a", "b"})
    push = StepPush(
        7, Position(0, 8), {"a": [("g", torch.ones(1))], "b": [("h", torch.ones(1))]}, blocks_into=stage
    )
    transfers = Transfers(channels, BLOCKS)
    transfers.channels.run_parallel = lambda jobs: (_ for _ in ()).throw(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        transfers.push_all(push)
    assert sorted(channels.events) == [("abandon", "a"), ("abandon", "b"), ("send", "a"), ("send", "b")]


def test_rows_asked_ahead_land_in_new_tensors_and_blocks_where_the_push_says():
    landed = {}
    into = BlocksAndNextRows(
        SimpleNamespace(dtype_and_shape={"blk": ("float32", [2])}.get),
        stage,
        {"t@rows": ("float32", [3, 4])},
        landed,
    )
    assert into.dtype_and_shape("blk") == ("float32", [2]) and into.dtype_and_shape("t@rows") == (
        "float32",
        [3, 4],
    )
    assert into.dtype_and_shape("nope") is None
    rows = into("t@rows")
    assert rows.shape == (3, 4) and landed == {"t@rows": rows} and into("blk").numel() == 0


def healing(step, what, calls):
    """A heal that retries until the calls go through (what Recovery does when the pservers come back)."""
    while True:
        try:
            calls()
            return None
        except PserverError:
            continue


@pytest.mark.parametrize(
    "streamed, failing, attempts",
    [
        (False, (), ["push"]),
        (False, ("b",), ["push", "push"]),  # a failed push goes again, to every pserver
        (True, (), ["streams ended"]),  # the streams opened during backward were the push
        (True, ("streams",), ["streams ended", "push"]),  # streams cannot be resent: the retry pushes whole
    ],
)
def test_the_healed_push_sends_the_first_attempt_then_the_whole_push_until_it_goes_through(
    streamed, failing, attempts
):
    channels = ScriptedChannels(failing=[f for f in failing if f != "streams"])
    done = []

    def end_streams():
        done.append("streams ended")
        if "streams" in failing:
            raise PserverError("b", "UNAVAILABLE: gone", DOWN)

    stepper = SimpleNamespace(transfers=Transfers(channels, BLOCKS), _heal=healing)
    push = StepPush(3, Position(0, 4), {"a": [], "b": []}, blocks_into=stage)
    pushed = Stepper.push(stepper, push, end_streams if streamed else None)
    assert pushed.resync is None
    # What the answers reported: each pserver's step, from the last attempt that was a push.
    assert sorted(pushed.pserver_steps) == (["a", "b"] if attempts[-1] == "push" else [])
    rounds = len(channels.sent) // 2  # each push goes to a and b, a failed one too
    assert done + ["push"] * rounds == attempts
