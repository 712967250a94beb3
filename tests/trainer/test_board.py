"""trainer/board, the pure parts: settings, step times, batch sizes, scalar checks, pserver tags, Stats
rounds.

What a job writes, read back with TensorBoard's own reader, is in tests/trainer/test_tensorboard.py.
"""

from __future__ import annotations

import logging
import math
import sys
import threading

import numpy as np
import pytest
import torch

from psproto import ps_pb2
from tests.helpers import paths
from trainer.board import writer as board_writer
from trainer.board.meter import StepMeter, Window, batch_size
from trainer.board.pserver_stats import StatsPoller, pserver_scalars
from trainer.board.settings import BoardSettings, run_name
from trainer.errors import PserverError
from trainer.launch import plan as launch_plan
from trainer.launch.plan import LaunchError
from transpiler import DistributeTranspilerConfig

PROBE = str(paths.REPO / "tests" / "scripts" / "role_probe.py")

# ---------------------------------------------------------------- settings


@pytest.mark.parametrize(
    "fields, environ, expected",
    [
        ({}, {}, (None, "first", 20)),
        ({}, {"PS_TENSORBOARD_DIR": "/tmp/tb"}, ("/tmp/tb", "first", 20)),
        ({}, {"PS_TENSORBOARD_DIR": "  "}, (None, "first", 20)),
        ({"tensorboard_dir": "/a"}, {"PS_TENSORBOARD_DIR": "/b"}, ("/a", "first", 20)),  # the field wins
        ({}, {"PS_TENSORBOARD_TRAINERS": "ALL", "PS_TENSORBOARD_EVERY": "5"}, (None, "all", 5)),
        (
            {"tensorboard_trainers": "first", "tensorboard_every": 3},
            {"PS_TENSORBOARD_TRAINERS": "all", "PS_TENSORBOARD_EVERY": "7"},
            (None, "first", 3),
        ),
    ],
)
def test_settings_take_each_field_else_its_variable_else_the_default(fields, environ, expected):
    s = BoardSettings.resolve(DistributeTranspilerConfig(**fields), environ)
    assert (s.directory, s.trainers, s.every) == expected


@pytest.mark.parametrize(
    "environ, match",
    [
        ({"PS_TENSORBOARD_TRAINERS": "some"}, "PS_TENSORBOARD_TRAINERS='some' is not one of"),
        ({"PS_TENSORBOARD_EVERY": "0"}, "PS_TENSORBOARD_EVERY='0' is not a number of steps >= 1"),
        ({"PS_TENSORBOARD_EVERY": "ten"}, "PS_TENSORBOARD_EVERY='ten'"),
        ({"PS_TENSORBOARD_EVERY": "-3"}, "PS_TENSORBOARD_EVERY='-3'"),
    ],
)
def test_a_malformed_variable_is_refused_by_name(environ, match):
    with pytest.raises(ValueError, match=match):
        BoardSettings.resolve(DistributeTranspilerConfig(), environ)


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"tensorboard_dir": ""}, "tensorboard_dir must be None or a non-empty path"),
        ({"tensorboard_dir": 3}, "tensorboard_dir must be None or a non-empty path"),
        (
            {"tensorboard_trainers": "rank0"},
            r"tensorboard_trainers must be None or one of \('first', 'all'\)",
        ),
        ({"tensorboard_every": 0}, "tensorboard_every must be None or an int >= 1"),
        ({"tensorboard_every": True}, "tensorboard_every must be None or an int >= 1"),
        ({"tensorboard_every": 2.5}, "tensorboard_every must be None or an int >= 1"),
    ],
)
def test_bad_tensorboard_fields_are_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        DistributeTranspilerConfig(**fields).validate()


@pytest.mark.parametrize(
    "directory, trainers, rank, writes",
    [
        (None, "first", 0, False),
        (None, "all", 3, False),
        ("/d", "first", 0, True),
        ("/d", "first", 1, False),
        ("/d", "all", 1, True),
    ],
)
def test_who_writes(directory, trainers, rank, writes):
    assert BoardSettings(directory, trainers).writes(rank) is writes


def test_each_process_has_its_own_run():
    assert [run_name(0, 0), run_name(3, 0), run_name(3, 2)] == ["trainer-0", "trainer-3", "trainer-3.2"]


# ---------------------------------------------------------------- ps-launch


def test_ps_launch_gives_every_role_the_directory_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = launch_plan.parse_args(
        ["--server_num", "1", "--worker_num", "2", "--tensorboard_dir", "tb", PROBE]
    )
    roles = launch_plan.plan_roles(args, environ={}, pick_ports=lambda n: [7100 + i for i in range(n)])
    assert [r.env["PS_TENSORBOARD_DIR"] for r in roles] == [str(tmp_path / "tb")] * 3
    plain = launch_plan.plan_roles(
        launch_plan.parse_args(["--server_num", "1", "--worker_num", "1", PROBE]),
        environ={},
        pick_ports=lambda n: [7100 + i for i in range(n)],
    )
    assert not any("PS_TENSORBOARD_DIR" in r.env for r in plain)


def test_ps_launch_refuses_a_tensorboard_dir_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("")
    args = launch_plan.parse_args(
        ["--server_num", "1", "--worker_num", "1", "--tensorboard_dir", str(tmp_path / "f"), PROBE]
    )
    with pytest.raises(LaunchError, match="is not a directory"):
        launch_plan.plan_roles(args, environ={})


# ---------------------------------------------------------------- batches and scalars


@pytest.mark.parametrize(
    "item, size",
    [
        (torch.zeros(7, 3), 7),
        (torch.tensor(2.0), 1),
        (np.zeros((5, 2)), 5),
        ((torch.zeros(4, 2), torch.zeros(4)), 4),
        ([1, torch.zeros(6)], 6),  # the first tensor found
        ({"ids": torch.zeros(9, 3), "y": torch.zeros(9)}, 9),
        (((torch.zeros(3, 2), torch.zeros(3)), torch.zeros(3)), 3),  # one level of nesting
        ("text", 0),
        ((1, 2), 0),
        ({}, 0),
    ],
)
def test_batch_size_is_dim0_of_the_batch_or_its_first_tensor(item, size):
    assert batch_size(item) == size


def test_scalar_values_takes_numbers_and_one_element_tensors():
    got = board_writer.scalar_values(
        {"loss": torch.tensor([0.25]), "n": 3, "x": np.float32(1.5), "nan": math.nan}
    )
    assert got == {"loss": 0.25, "n": 3.0, "x": 1.5, "nan": got["nan"]} and math.isnan(got["nan"])


@pytest.mark.parametrize(
    "values, match",
    [
        ([("loss", 1.0)], "takes a mapping of tag -> number, got list"),
        ({"": 1.0}, "tag must be a non-empty string"),
        ({3: 1.0}, "tag must be a non-empty string, got 3"),
        ({"loss": torch.zeros(2)}, r"'loss' must have one element, got a tensor of shape \(2,\)"),
        ({"loss": "0.5"}, "'loss' must be a real number, got str"),
        ({"flag": True}, "'flag' must be a real number, got bool"),
        ({"c": 1j}, "'c' must be a real number, got complex"),
    ],
)
def test_bad_scalars_are_refused_naming_the_tag(values, match):
    with pytest.raises(ValueError, match=match):
        board_writer.scalar_values(values)


# ---------------------------------------------------------------- step times


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_the_meter_splits_each_step_into_compute_and_inside_step_over_a_window():
    clock = FakeClock()
    meter = StepMeter(clock)
    clock.now += 50.0  # the script's set-up: no step's time
    for compute, inside in ((0.3, 0.1), (0.2, 0.2)):
        meter.batch(64)
        clock.now += compute
        meter.step_begins()
        clock.now += inside
        meter.step_ends()
    meter.batch(64)  # read, never trained (the loop broke): counts nothing
    clock.now += 9.0  # an evaluation after the last step: no step's time
    window = meter.take()
    assert window == Window(
        steps=2,
        examples=128,
        seconds=pytest.approx(0.8),
        compute=pytest.approx(0.5),
        inside=pytest.approx(0.3),
    )
    assert window.scalars("step_time/push_pull_ms") == {
        "throughput/steps_per_s": pytest.approx(2.5),
        "throughput/examples_per_s": pytest.approx(160.0),
        "step_time/compute_ms": pytest.approx(250.0),
        "step_time/push_pull_ms": pytest.approx(150.0),
    }
    assert meter.take() is None  # nothing since: no window


def test_batches_of_one_step_all_count_and_unsized_batches_leave_examples_out():
    clock = FakeClock()
    meter = StepMeter(clock)
    for _ in range(3):  # gradient accumulation: three batches, one step
        meter.batch(10)
    clock.now += 1.0
    meter.step_begins()
    meter.step_ends()
    assert meter.take().examples == 30
    meter.batch(0)
    clock.now += 1.0
    meter.step_begins()
    meter.step_ends()
    assert "throughput/examples_per_s" not in meter.take().scalars("step_time/optimizer_ms")


# ---------------------------------------------------------------- pserver tags


def reply(pserver_step=40, pushes=80, uptime=10.0, incarnation=7, tables=(), lag=None):
    r = ps_pb2.StatsReply(
        step=pserver_step,
        pushes=pushes,
        uptime_s=uptime,
        incarnation=incarnation,
        tables=[
            ps_pb2.TableStats(table=t, rows=rows, disk_rows=disk, evicted=ev) for t, rows, disk, ev in tables
        ],
    )
    if lag is not None:
        r.replica.CopyFrom(ps_pb2.ReplicaStats(role="primary", lag=lag))
    return r


@pytest.mark.parametrize(
    "now, previous, expected",
    [
        (reply(), None, {"pserver1/applied_step": 40.0, "pserver1/pushes_per_s": 8.0}),  # since start
        (
            reply(pushes=80, uptime=10.0),
            reply(pushes=60, uptime=8.0),
            {"pserver1/applied_step": 40.0, "pserver1/pushes_per_s": 10.0},
        ),  # between replies
        (
            reply(pushes=5, uptime=1.0, incarnation=8),
            reply(pushes=60, uptime=8.0),
            {"pserver1/applied_step": 40.0, "pserver1/pushes_per_s": 5.0},
        ),  # a restarted pserver
        (reply(uptime=0.0), None, {"pserver1/applied_step": 40.0}),
        (
            reply(tables=[("emb", 100, 30, 4)], lag=2),
            None,
            {
                "pserver1/applied_step": 40.0,
                "pserver1/pushes_per_s": 8.0,
                "pserver1/rows_in_memory/emb": 70.0,
                "pserver1/rows_on_disk/emb": 30.0,
                "pserver1/evictions/emb": 4.0,
                "pserver1/replication_lag": 2.0,
            },
        ),
    ],
)
def test_pserver_scalars_of_a_stats_reply(now, previous, expected):
    assert pserver_scalars(1, now, previous) == expected


class Rounds:
    """An AskStats whose answers a test gives; ``gate`` holds a round until released."""

    def __init__(self, answers):
        self.answers = answers
        self.gate = threading.Event()
        self.gate.set()
        self.asked = 0

    def __call__(self, timeout):
        self.asked += 1
        assert self.gate.wait(10)
        return self.answers(self.asked)


def test_a_round_asked_while_one_runs_is_dropped_never_queued():
    written = []
    done = threading.Event()
    ask = Rounds(lambda n: {"a:1": reply(pserver_step=n)})
    ask.gate.clear()
    poller = StatsPoller(ask, ["a:1"], lambda values, step: (written.append((step, values)), done.set()))
    try:
        poller.request(5)
        poller.request(10)  # asked or running already: dropped
        poller.request(15)
        ask.gate.set()
        assert done.wait(10)
        assert poller.dropped == 2
        poller.final(20)  # the last round, on this thread
    finally:
        poller.stop()
    assert [(s, v["pserver0/applied_step"]) for s, v in written] == [(5, 1.0), (20, 2.0)]
    assert ask.asked == 2


def test_a_pserver_that_does_not_answer_is_logged_once_and_left_out_until_it_answers(caplog):
    down = PserverError("b:2", "Stats failed: unavailable")
    answers = {
        1: {"a:1": reply(), "b:2": down},
        2: {"a:1": reply(), "b:2": down},
        3: {"a:1": reply(), "b:2": reply(pserver_step=41)},
    }
    written = []
    poller = StatsPoller(Rounds(answers.__getitem__), ["a:1", "b:2"], lambda v, step: written.append(v))
    poller.stop()
    with caplog.at_level(logging.INFO, logger="trainer.board.pserver_stats"):
        for step in (1, 2, 3):
            poller.final(step)
    assert [("pserver1/applied_step" in v) for v in written] == [False, False, True]
    assert all("pserver0/applied_step" in v for v in written)
    assert [r.levelname for r in caplog.records] == ["WARNING", "INFO"]
    assert "no Stats from pserver b:2" in caplog.records[0].getMessage()
    assert "b:2 answers Stats again" in caplog.records[1].getMessage()


# ---------------------------------------------------------------- tensorboard missing


def test_without_tensorboard_nothing_is_written_and_one_line_says_so(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    monkeypatch.setattr(board_writer, "_missing_logged", False)
    config = DistributeTranspilerConfig(tensorboard_dir=str(tmp_path / "tb"))
    with caplog.at_level(logging.WARNING, logger="trainer.board.writer"):
        boards = [board_writer.open_board(config, 0, 0, 0, "step_time/push_pull_ms") for _ in range(2)]
    assert all(b is board_writer.NULL_BOARD for b in boards)
    assert len(caplog.records) == 1
    assert "tensorboard package is not installed" in caplog.records[0].getMessage()
    assert 'pip install "torch-pserver[tensorboard]"' in caplog.records[0].getMessage()
    assert not (tmp_path / "tb").exists()
