"""ps-launch's restart decision (pure, table-driven) and the command line it comes with."""

from __future__ import annotations

import re
import signal

import pytest

from tests.helpers import paths
from trainer.launch import plan as launch_plan
from trainer.launch.args import LOG_LEVEL_VAR
from trainer.launch.plan import PSERVER, TRAINER, LaunchError
from trainer.launch.restart import FINISHED, RESTART, STOP, decide_restart, exit_reason
from trainer.launch.role import child_env

REPO = paths.REPO
PROBE = str(REPO / "tests" / "scripts" / "role_probe.py")
KILL, TERM, SEGV = -signal.SIGKILL, -signal.SIGTERM, -signal.SIGSEGV


# (kind, returncode, restarts used, max_restarts, trainers done) -> (action, reason)
DECISIONS = [
    # exit 0 is the end of a role's work, whatever the budget
    ((TRAINER, 0, 0, 0, False), (FINISHED, "exited with code 0")),
    ((PSERVER, 0, 3, 3, True), (FINISHED, "exited with code 0")),
    # no restarts asked for: any death stops the job, in today's words
    ((TRAINER, 3, 0, 0, False), (STOP, "exited with code 3")),
    ((PSERVER, KILL, 0, 0, False), (STOP, "was killed by SIGKILL")),
    # restarts left: an exit code or a signal restarts, counting from 1
    ((PSERVER, KILL, 0, 1, False), (RESTART, "was killed by SIGKILL; restart 1 of 1")),
    ((TRAINER, KILL, 0, 2, False), (RESTART, "was killed by SIGKILL; restart 1 of 2")),
    ((TRAINER, 1, 1, 2, False), (RESTART, "exited with code 1; restart 2 of 2")),
    ((TRAINER, SEGV, 0, 1, False), (RESTART, "was killed by SIGSEGV; restart 1 of 1")),
    ((TRAINER, TERM, 0, 1, True), (RESTART, "was killed by SIGTERM; restart 1 of 1")),
    ((PSERVER, 5, 2, 5, False), (RESTART, "exited with code 5; restart 3 of 5")),
    # budget spent: stop, saying so
    ((PSERVER, KILL, 1, 1, False), (STOP, "was killed by SIGKILL with no restarts left (1 of 1 used)")),
    ((TRAINER, 3, 2, 2, False), (STOP, "exited with code 3 with no restarts left (2 of 2 used)")),
    # a pserver dying after every local trainer finished has nobody to resume with
    (
        (PSERVER, KILL, 0, 3, True),
        (STOP, "was killed by SIGKILL after every trainer had finished (not restarted)"),
    ),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("given, expected", DECISIONS, ids=[str(d[0]) for d in DECISIONS])
def test_restart_decision(given, expected):
    decision = decide_restart(*given)
    assert (decision.action, decision.reason) == expected


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "code, words",
    [
        (0, "exited with code 0"),
        (3, "exited with code 3"),
        (-9, "was killed by SIGKILL"),
        (-15, "was killed by SIGTERM"),
        (-200, "was killed by signal 200"),
    ],
)
def test_exit_reason(code, words):
    assert exit_reason(code) == words


# ---------------------------------------------------------------- the command line


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "argv, attrs",
    [
        (["--server_num", "2", "--worker_num", "3"], {"server_num": 2, "worker_num": 3, "max_restarts": 0}),
        # torchrun's dash spellings
        (
            [
                "--server-num",
                "2",
                "--worker-num",
                "3",
                "--max-restarts",
                "4",
                "--log-dir",
                "L",
                "--log-level",
                "debug",
                "--start-port",
                "7000",
                "--server-grace",
                "1",
                "--term-timeout",
                "2",
                "--nproc-per-node",
                "1",
                "--master-port",
                "7100",
            ],
            {
                "server_num": 2,
                "worker_num": 3,
                "max_restarts": 4,
                "log_dir": "L",
                "log_level": "DEBUG",
                "start_port": 7000,
                "server_grace": 1.0,
                "term_timeout": 2.0,
                "nproc_per_node": 1,
                "master_port": 7100,
            },
        ),
        # Paddle 2.x's names
        (
            ["--server_num", "1", "--trainer_num", "2", "--max_restart", "1", "--devices", "0,1"],
            {"worker_num": 2, "max_restarts": 1, "gpus": "0,1"},
        ),
        (["--trainer-num", "2", "--max-restart", "2"], {"worker_num": 2, "max_restarts": 2}),
        (
            ["--servers", "10.0.0.1:6170", "--trainers", "10.0.0.1:6171,10.0.0.2:6171"],
            {"servers": "10.0.0.1:6170", "workers": "10.0.0.1:6171,10.0.0.2:6171"},
        ),
        # --show: normalised role names
        (
            ["--worker_num", "1", "--show", "trainer.0,pserver1,Trainer0.1,trainer2.0"],
            {"show": ("trainer0", "pserver1", "trainer0.1", "trainer2")},
        ),
        (["--worker_num", "1", "--show", "all"], {"show": ("all",)}),
        (["--worker_num", "1"], {"show": None, "log_level": "INFO", "log_level_given": False}),
    ],
)
def test_option_spellings(argv, attrs, monkeypatch):
    monkeypatch.delenv(LOG_LEVEL_VAR, raising=False)
    args = launch_plan.parse_args([*argv, "train.py", "--max_restarts", "9"])
    assert args.script_args == ["--max_restarts", "9"]  # the script's own flags pass untouched
    for name, value in attrs.items():
        assert getattr(args, name) == value, name


@pytest.mark.timeout(10)
def test_log_level_comes_from_the_flag_or_the_variable(monkeypatch):
    monkeypatch.setenv(LOG_LEVEL_VAR, "warning")
    args = launch_plan.parse_args(["--worker_num", "1", PROBE])
    assert (args.log_level, args.log_level_given) == ("WARNING", False)
    # Inherited, it reaches the roles by inheritance: the plan does not set it.
    roles = launch_plan.plan_roles(args)
    assert all(LOG_LEVEL_VAR not in r.env for r in roles)
    args = launch_plan.parse_args(["--server_num", "1", "--worker_num", "1", "--log_level", "debug", PROBE])
    assert (args.log_level, args.log_level_given) == ("DEBUG", True)
    roles = launch_plan.plan_roles(args)
    assert [r.env[LOG_LEVEL_VAR] for r in roles] == ["DEBUG", "DEBUG"]
    assert child_env(roles[0], base={LOG_LEVEL_VAR: "ERROR"})[LOG_LEVEL_VAR] == "DEBUG"


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--worker_num", "1", "--log_level", "loud"], "'loud' is not a log level"),
        (["--worker_num", "1", "--show", "worker0"], "'worker0' is not a role"),
        (["--worker_num", "1", "--show", "none,trainer0"], "--show none cannot be combined"),
        (["--worker_num", "1", "--max_restarts", "x"], "invalid int value"),
    ],
)
def test_bad_options_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        launch_plan.parse_args([*argv, PROBE])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.timeout(10)
def test_bad_log_level_variable_exits_2(monkeypatch, capsys):
    monkeypatch.setenv(LOG_LEVEL_VAR, "chatty")
    with pytest.raises(SystemExit):
        launch_plan.parse_args(["--worker_num", "1", PROBE])
    assert f"{LOG_LEVEL_VAR}: 'chatty' is not a log level" in capsys.readouterr().err


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--server_num", "1", "--worker_num", "1", "--max_restarts", "-1"],
            "--max_restarts must be >= 0, got -1",
        ),
        (["--worker_num", "2", "--max_restarts", "1"], "--max_restarts needs pservers"),
    ],
)
def test_restart_plan_errors(argv, message):
    with pytest.raises(LaunchError, match=re.escape(message)):
        launch_plan.plan_roles(launch_plan.parse_args([*argv, PROBE]), environ={})


@pytest.mark.timeout(10)
def test_role_tags_and_units():
    roles = launch_plan.plan_roles(
        launch_plan.parse_args(["--server_num", "2", "--worker_num", "2", "--nproc_per_node", "2", PROBE]),
        pick_ports=lambda n: [7100 + i for i in range(n)],
        environ={},
    )
    assert [r.tag for r in roles] == [
        "pserver0",
        "pserver1",
        "trainer0",
        "trainer0.1",
        "trainer1",
        "trainer1.1",
    ]
    # (kind, index, replica): with hot standby a pserver's two processes restart on their own.
    assert [r.unit for r in roles] == [
        (PSERVER, 0, 0),
        (PSERVER, 1, 0),
        (TRAINER, 0, 0),
        (TRAINER, 0, 0),
        (TRAINER, 1, 0),
        (TRAINER, 1, 0),
    ]
