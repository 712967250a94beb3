"""ps-stat against in-process pservers: rows, JSON, unreachable pservers, bad input."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from torch import nn

from harness.cluster import LocalCluster
from harness.models import batches, odd_mlp
from harness.ports import free_ports
from pserver.ops import stat_cli
from psproto.security import Security
from transpiler import Program

STEPS = 3


@pytest.fixture(autouse=True)
def no_job_env(monkeypatch):
    # ps-stat reads the job's access settings from the environment; the tests' pservers have none.
    for var in (
        "PS_AUTH_TOKEN",
        "PS_AUTH_TOKEN_FILE",
        "PS_TLS_CERT",
        "PS_TLS_KEY",
        "PS_TLS_CA",
        "PS_TLS_CLIENT_CERT",
        "PS_TLS_CLIENT_KEY",
        "PS_TLS_SERVER_NAME",
        "PADDLE_PSERVERS_IP_PORT_LIST",
    ):
        monkeypatch.delenv(var, raising=False)


def build() -> Program:
    return Program(odd_mlp(), "sgd", lr=0.1)


def trained(cluster: LocalCluster):
    """Run STEPS sync steps on every trainer of ``cluster``."""
    data = batches(cluster.n_trainers, 4, STEPS)

    def body(tr, i):
        for step in data:
            x, y = step[i]
            nn.functional.cross_entropy(tr.model(x), y).backward()
            tr.step()

    cluster.run_trainers(body)


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(build, 2, 2) as c:
        trained(c)
        yield c


@pytest.mark.timeout(30)
def test_rows_name_each_pserver_with_its_step(cluster, capsys):
    assert stat_cli.main([",".join(cluster.endpoints), "--interval", "0.2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[:4] == ["ENDPOINT", "MODE", "LAYOUT", "STEP"]
    assert len(lines) == 1 + len(cluster.endpoints)
    for ep, line in zip(cluster.endpoints, lines[1:]):
        cells = line.split()
        assert cells[0] == ep and cells[1] == "sync" and cells[2:4] == ["epoch", "0"]
        assert cells[4] == str(STEPS)
        assert cells[5] == "-"  # both trainers closed


@pytest.mark.timeout(30)
def test_json_has_every_field(cluster, capsys, monkeypatch):
    monkeypatch.setenv("PADDLE_PSERVERS_IP_PORT_LIST", ",".join(cluster.endpoints))
    assert stat_cli.main(["--json", "--interval", "0"]) == 0
    objects = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [o["endpoint"] for o in objects] == cluster.endpoints
    for o in objects:
        assert o["step"] == STEPS and o["sync_mode"] is True
        assert o["layout_epoch"] == 0 and o["routing_version"] == 2
        assert o["pushes"] == 2 * STEPS and isinstance(o["block_bytes"], int)
        assert "pushes_per_s" in o and "checkpoint_step" in o and "uptime_s" in o


@pytest.mark.timeout(30)
def test_live_trainers_and_push_rate(capsys, monkeypatch):
    data = batches(1, 4, 6)
    with LocalCluster(build, 1, 1) as c:
        with c.trainer(0) as tr:

            def step(i):  # one sync step: one push
                x, y = data[i][0]
                nn.functional.cross_entropy(tr.model(x), y).backward()
                tr.step()

            def json_stats(*args):
                assert stat_cli.main([c.endpoints[0], "--json", *args]) == 0
                (obj,) = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
                return obj

            step(0)
            assert stat_cli.main([c.endpoints[0], "--interval", "0"]) == 0
            cells = capsys.readouterr().out.strip().splitlines()[1].split()
            assert cells[4:6] == ["1", "0"]
            # --interval 0: the mean since the pserver started.
            obj = json_stats("--interval", "0")
            assert obj["pushes"] == 1 and obj["uptime_s"] > 0
            assert (
                obj["pushes_per_s"] == pytest.approx(1 / obj["uptime_s"], rel=1e-9)
                and obj["pushes_per_s"] > 0
            )
            # No push between the two samples: 0.
            obj = json_stats("--interval", "0.1")
            assert obj["trainers_alive"] == [0] and obj["pushes"] == 1 and obj["pushes_per_s"] == 0.0
            # Pushes between the two samples: ps-stat's wait between them is replaced by exactly
            # three sync steps, so the rate over the 0.5 s it believes passed is 6 pushes/s.
            waits = []

            def three_steps(seconds):
                waits.append(seconds)
                for i in (1, 2, 3):
                    step(i)

            monkeypatch.setattr(stat_cli, "time", SimpleNamespace(sleep=three_steps))
            obj = json_stats("--interval", "0.5")
            assert waits == [0.5]
            assert obj["step"] == 4 and obj["pushes"] == 4 and obj["pushes_per_s"] == 6.0
            assert obj["trainers_alive"] == [0]
            # The table's PUSHES/S column: two steps over 0.25 s.
            monkeypatch.setattr(stat_cli, "time", SimpleNamespace(sleep=lambda seconds: (step(4), step(5))))
            assert stat_cli.main([c.endpoints[0], "--interval", "0.25"]) == 0
            header, line = capsys.readouterr().out.strip().splitlines()
            assert line[header.index("PUSHES/S") :].split()[0] == "8.0"
            assert line.split()[4] == "6"


@pytest.mark.timeout(30)
def test_unreachable_pserver_gives_a_row_and_exit_1(cluster, capsys):
    (dead,) = [f"127.0.0.1:{p}" for p in free_ports(1)]
    assert stat_cli.main([f"{cluster.endpoints[0]},{dead}", "--interval", "0", "--timeout", "3"]) == 1
    out = capsys.readouterr().out
    (row,) = [line for line in out.splitlines() if line.startswith(dead)]
    assert "UNAVAILABLE" in row
    assert stat_cli.main([dead, "--json", "--interval", "0", "--timeout", "3"]) == 1
    obj = json.loads(capsys.readouterr().out)
    assert obj["endpoint"] == dead and obj["error"].startswith("UNAVAILABLE")


@pytest.mark.timeout(30)
def test_a_refusing_pserver_shows_unauthenticated(capsys, monkeypatch):
    with LocalCluster(build, 1, 1, security=Security(token="t0ken")) as c:
        assert stat_cli.main([c.endpoints[0], "--interval", "0"]) == 1
        assert "UNAUTHENTICATED" in capsys.readouterr().out
        monkeypatch.setenv("PS_AUTH_TOKEN", "t0ken")
        assert stat_cli.main([c.endpoints[0], "--interval", "0"]) == 0


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "no endpoints"),
        (["127.0.0.1"], "host:port"),
        (["127.0.0.1:1", "--interval", "-1"], "--interval"),
        (["127.0.0.1:1", "--timeout", "0"], "--timeout"),
        (["127.0.0.1:1", "--bogus"], "unrecognized"),
    ],
)
def test_bad_arguments_exit_2(argv, message, capsys):
    assert stat_cli.main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.timeout(10)
def test_bad_security_settings_exit_2(capsys, monkeypatch):
    monkeypatch.setenv("PS_TLS_CLIENT_CERT", "/nonexistent.pem")
    assert stat_cli.main(["127.0.0.1:1"]) == 2
    assert "PS_TLS_CLIENT" in capsys.readouterr().err


def test_human_bytes():
    assert [stat_cli.human_bytes(n) for n in (0, 512, 1536, 3 * 2**30)] == [
        "0 B",
        "512 B",
        "1.5 KiB",
        "3.0 GiB",
    ]
