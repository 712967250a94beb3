"""ps-launch, the pure pieces: argument parsing, role planning, child environments, the table (trainer
nodes' plans: tests/launch/test_plan_nodes.py)."""

from __future__ import annotations

import re
import sys

import pytest

from tests.helpers import paths
from tests.helpers.launch import PROBE, args_for
from trainer import launch
from trainer.launch import hosts
from trainer.launch import plan as launch_plan
from trainer.launch.plan import PSERVER, TRAINER, LaunchError
from trainer.launch.role import child_env
from transpiler import RoleEnv

REPO = paths.REPO


# ---------------------------------------------------------------- argument parsing


@pytest.mark.timeout(10)
def test_script_args_pass_through_untouched():
    args = launch_plan.parse_args(
        ["--server_num", "2", "--log_dir", "L", "train.py", "--async", "--log_dir", "x", "--", "-v"]
    )
    assert (args.server_num, args.log_dir, args.script) == (2, "L", "train.py")
    assert args.script_args == ["--async", "--log_dir", "x", "--", "-v"]
    args = launch_plan.parse_args(["--worker_num=3", "--", "train.py", "--epochs", "3"])
    assert (args.worker_num, args.script, args.script_args) == (3, "train.py", ["--epochs", "3"])


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "argv", [[], ["--server_num", "2"], ["--server", "2", "x.py"], ["--server_num", "two", "x.py"]]
)
def test_parse_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        launch_plan.parse_args(argv)
    assert e.value.code == 2
    assert "ps-launch: error" in capsys.readouterr().err


# ---------------------------------------------------------------- role planning


@pytest.mark.timeout(10)
def test_local_mode_plan():
    roles = launch_plan.plan_roles(
        args_for("--server_num", "2", "--worker_num", "3"), pick_ports=lambda n: [7100 + i for i in range(n)]
    )
    assert [(r.kind, r.index) for r in roles] == [
        (PSERVER, 0),
        (PSERVER, 1),
        (TRAINER, 0),
        (TRAINER, 1),
        (TRAINER, 2),
    ]
    assert [r.endpoint for r in roles[:2]] == ["127.0.0.1:7100", "127.0.0.1:7101"]
    assert [r.log_name for r in roles] == [
        "serverlog.0",
        "serverlog.1",
        "workerlog.0",
        "workerlog.1",
        "workerlog.2",
    ]
    for r in roles:
        assert r.env["PADDLE_PSERVERS_IP_PORT_LIST"] == "127.0.0.1:7100,127.0.0.1:7101"
        assert r.env["PADDLE_TRAINERS_NUM"] == "3"
        assert r.env["TRAINING_ROLE"] == r.kind
    assert roles[1].env["POD_IP"] == "127.0.0.1" and roles[1].env["PADDLE_PORT"] == "7101"
    assert "PADDLE_TRAINER_ID" not in roles[0].env
    assert [r.env["PADDLE_TRAINER_ID"] for r in roles[2:]] == ["0", "1", "2"]
    assert not any("POD_IP" in r.env for r in roles[2:])


@pytest.mark.timeout(10)
def test_local_mode_ports():
    roles = launch_plan.plan_roles(args_for("--server_num", "3", "--worker_num", "1", "--start_port", "6170"))
    assert [r.endpoint for r in roles if r.kind == PSERVER] == [
        "127.0.0.1:6170",
        "127.0.0.1:6171",
        "127.0.0.1:6172",
    ]
    ports = hosts.free_ports(4)
    assert len(set(ports)) == 4 and all(0 < p < 65536 for p in ports)
    roles = launch_plan.plan_roles(args_for("--server_num", "2", "--worker_num", "1"))
    assert len({r.endpoint for r in roles if r.kind == PSERVER}) == 2


@pytest.mark.timeout(10)
def test_per_host_plan_keeps_this_hosts_roles_with_global_ids():
    args = args_for(
        "--servers",
        "10.0.0.1:6170,10.0.0.2:6170,10.0.0.1:6171",
        "--workers",
        "10.0.0.2,10.0.0.1,10.0.0.1:6200",
    )
    roles = launch_plan.plan_roles(args, is_local=lambda h: h == "10.0.0.1")
    assert [(r.kind, r.index) for r in roles] == [(PSERVER, 0), (PSERVER, 2), (TRAINER, 1), (TRAINER, 2)]
    assert [r.endpoint for r in roles[:2]] == ["10.0.0.1:6170", "10.0.0.1:6171"]
    assert roles[1].env["POD_IP"] == "10.0.0.1" and roles[1].env["PADDLE_PORT"] == "6171"
    for r in roles:
        assert r.env["PADDLE_PSERVERS_IP_PORT_LIST"] == "10.0.0.1:6170,10.0.0.2:6170,10.0.0.1:6171"
        assert r.env["PADDLE_TRAINERS_NUM"] == "3"
    assert [r.env["PADDLE_TRAINER_ID"] for r in roles[2:]] == ["1", "2"]

    other = launch_plan.plan_roles(args, is_local=lambda h: h == "10.0.0.2")
    assert [(r.kind, r.index) for r in other] == [(PSERVER, 1), (TRAINER, 0)]


@pytest.mark.timeout(10)
def test_per_host_filtering_by_host_flag_and_mixed_modes():
    roles = launch_plan.plan_roles(
        args_for(
            "--servers",
            "127.0.0.1:6170,127.0.0.2:6170",
            "--workers",
            "127.0.0.2,127.0.0.1",
            "--host",
            "127.0.0.2",
        )
    )
    assert [(r.kind, r.index) for r in roles] == [(PSERVER, 1), (TRAINER, 0)]
    # Pservers from the cluster list, trainers all local.
    roles = launch_plan.plan_roles(
        args_for("--servers", "127.0.0.1:6170,10.255.0.1:6170", "--worker_num", "2"),
        is_local=lambda h: h.startswith("127."),
    )
    assert [(r.kind, r.index) for r in roles] == [(PSERVER, 0), (TRAINER, 0), (TRAINER, 1)]
    assert roles[1].env["PADDLE_TRAINERS_NUM"] == "2"


@pytest.mark.timeout(10)
def test_host_matcher():
    explicit = hosts.host_matcher("10.0.0.1")
    assert explicit("10.0.0.1") and not explicit("10.0.0.2") and not explicit("127.0.0.1")
    auto = hosts.host_matcher(None)
    assert auto("127.0.0.1") and auto("127.0.0.2") and auto("localhost")
    assert all(auto(a) for a in hosts.local_addresses())
    assert not auto("203.0.113.7")  # TEST-NET-3: never a local address


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--server_num", "1", "--servers", "127.0.0.1:6170", "--worker_num", "1"],
            "--server_num and --servers",
        ),
        (["--server_num", "1", "--worker_num", "1", "--workers", "127.0.0.1"], "--worker_num and --workers"),
        (["--server_num", "1"], "no trainers"),
        (["--servers", "127.0.0.1:6170"], "no trainers"),
        (["--server_num", "0", "--worker_num", "1"], "--server_num must be >= 1"),
        (["--server_num", "1", "--worker_num", "0"], "--worker_num must be >= 1"),
        (["--servers", "127.0.0.1", "--worker_num", "1"], "not of the form host:port"),
        (["--servers", "127.0.0.1:http", "--worker_num", "1"], "not of the form host:port"),
        (["--servers", "127.0.0.1:70000", "--worker_num", "1"], "not of the form host:port"),
        (["--servers", "127.0.0.1:1,127.0.0.1:1", "--worker_num", "1"], "listed twice"),
        (["--servers", "", "--worker_num", "1"], "empty"),
        (["--server_num", "1", "--workers", "127.0.0.1,,127.0.0.1"], "malformed"),
        (["--servers", "127.0.0.1:6170", "--worker_num", "1", "--start_port", "7000"], "--start_port"),
        (["--server_num", "2", "--worker_num", "1", "--start_port", "65535"], "--start_port"),
        (["--server_num", "1", "--worker_num", "1", "--server_grace", "-1"], ">= 0"),
        (["--servers", "10.255.0.1:6170", "--workers", "10.255.0.2", "--host", "10.255.0.3"], "has no role"),
        # trainer nodes, GPUs, collective mode
        (["--worker_num", "1", "--nproc_per_node", "0"], "--nproc_per_node must be >= 1"),
        (
            ["--server_num", "1", "--worker_num", "1", "--gpus", "0", "--nproc_per_node", "2"],
            "--nproc_per_node 2 x 1 trainer node(s) on this host need 2 GPUs, --gpus lists 1 (0)",
        ),
        (
            ["--server_num", "1", "--worker_num", "2", "--gpus", "0,1,2"],
            "--gpus lists 3 GPUs for 2 trainer nodes on this host: give --nproc_per_node",
        ),
        (
            ["--server_num", "1", "--worker_num", "2", "--gpus", "0,1,2", "--nproc_per_node", "2"],
            "need 4 GPUs",
        ),
        (["--worker_num", "1", "--gpus", "0,,1"], "--gpus '0,,1' is malformed"),
        (["--worker_num", "1", "--gpus", "1,0,1"], "--gpus lists GPU 1 twice"),
        (["--worker_num", "1", "--start_port", "7000"], "a collective job has no pservers"),
        (["--worker_num", "1", "--master_port", "70000"], "--master_port must be a port number"),
        (
            ["--server_num", "1", "--worker_num", "2", "--nproc_per_node", "2", "--master_port", "65535"],
            "leaves no room for 2 nodes",
        ),
        (
            [
                "--server_num",
                "1",
                "--worker_num",
                "1",
                "--nproc_per_node",
                "2",
                "--start_port",
                "7000",
                "--master_port",
                "7000",
            ],
            "rendezvous port is a pserver's: ['127.0.0.1:7000']",
        ),
    ],
)
def test_plan_errors(argv, message):
    with pytest.raises(LaunchError, match=re.escape(message)):
        launch_plan.plan_roles(args_for(*argv), environ={})


@pytest.mark.timeout(10)
def test_gpus_must_be_among_the_launchers_visible_devices():
    args = args_for("--server_num", "1", "--worker_num", "1", "--gpus", "5,2")
    with pytest.raises(
        LaunchError, match=re.escape("GPU 2 is not in this launcher's CUDA_VISIBLE_DEVICES=4,5,6")
    ):
        launch_plan.plan_roles(args, environ={"CUDA_VISIBLE_DEVICES": "4,5,6"})


@pytest.mark.timeout(10)
def test_missing_script_is_an_error():
    with pytest.raises(LaunchError, match="not found"):
        launch_plan.plan_roles(
            args_for("--server_num", "1", "--worker_num", "1", script="/nonexistent/train.py")
        )


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "argv",
    [
        ["--server_num", "0", "--worker_num", "1", PROBE],
        ["--server_num", "1", "--worker_num", "1", "missing_script.py"],
        ["--servers", "10.255.0.1:6170", "--workers", "10.255.0.2", PROBE],
    ],
)
def test_main_bad_input_exits_2_and_starts_nothing(argv, tmp_path, capsys):
    log_dir = tmp_path / "logs"
    assert launch.main(["--log_dir", str(log_dir), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ps-launch: error: ")
    assert not log_dir.exists()


# ---------------------------------------------------------------- environment and table


@pytest.mark.timeout(10)
def test_child_env_is_the_role_env_plus_inherited_environment():
    roles = launch_plan.plan_roles(
        args_for("--server_num", "2", "--worker_num", "2"), pick_ports=lambda n: [7200 + i for i in range(n)]
    )
    # A stale role from an outer job must not leak into ours.
    base = {"PS_AUTH_TOKEN": "s3cret", "PATH": "/bin", "PADDLE_TRAINER_ID": "7", "POD_IP": "10.9.9.9"}
    for role in roles:
        env = child_env(role, base)
        assert env["PS_AUTH_TOKEN"] == "s3cret" and env["PATH"] == "/bin"
        assert env["PYTHONUNBUFFERED"] == "1"
        parsed = RoleEnv.from_env(env)
        assert parsed.role == role.kind
        assert parsed.pservers == ["127.0.0.1:7200", "127.0.0.1:7201"] and parsed.trainers == 2
        if role.kind == PSERVER:
            assert parsed.current_endpoint == role.endpoint and "PADDLE_TRAINER_ID" not in env
        else:
            assert parsed.trainer_id == role.index and "POD_IP" not in env


@pytest.mark.timeout(10)
def test_table_and_tail(tmp_path):
    roles = launch_plan.plan_roles(
        args_for("--server_num", "1", "--worker_num", "2"), pick_ports=lambda n: [7300]
    )
    roles[0].log_path = "log/serverlog.0"
    table = launch.format_table(roles).splitlines()
    assert table[0].split()[:3] == ["ROLE", "INDEX", "ENDPOINT"]
    assert table[1].split()[:3] == ["PSERVER", "0", "127.0.0.1:7300"] and "log/serverlog.0" in table[1]
    assert table[3].split()[:2] == ["TRAINER", "1"]
    log = tmp_path / "log"
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    assert launch.tail(str(log)).splitlines() == [f"line {i}" for i in range(80, 100)]
    assert launch.tail(str(tmp_path / "missing")) == ""


@pytest.mark.timeout(10)
def test_role_command_runs_the_script_with_its_args_under_this_python():
    command = launch.role_command("train.py", ["--epochs", "3"])
    assert command[0] == sys.executable and command[-3:] == ["train.py", "--epochs", "3"]


@pytest.mark.timeout(10)
def test_unwritable_log_dir_is_bad_input(tmp_path, capsys):
    (tmp_path / "log").write_text("a file where the log directory should be")
    assert (
        launch.main(["--server_num", "1", "--worker_num", "1", "--log_dir", str(tmp_path / "log"), PROBE])
        == 2
    )
    assert "ps-launch: error:" in capsys.readouterr().err
