"""Access control: the shared auth token, TLS and mutual TLS, on loopback pservers.

Every test passes its own Security (never the process environment), so a
developer's PS_AUTH_TOKEN or PS_TLS_* cannot change the outcome.
"""

from __future__ import annotations

import os
import stat

import grpc
import pytest
import torch
from torch import nn

from harness.cluster import LocalCluster
from harness.models import batches, odd_mlp
from psproto import ps_pb2, ps_pb2_grpc
from psproto.certs import make_test_certs
from psproto.certs_cli import main as certs_main
from psproto.security import Security
from psproto.wire import SERVICE as SERVICE_NAME
from tests.helpers import paths
from tests.helpers.servicer import servicer
from trainer import Trainer
from trainer.errors import REFUSED as REFUSED_KIND
from trainer.errors import PserverError
from trainer.launch import plan as launch_plan
from trainer.launch.plan import LaunchError
from trainer.launch.role import child_env
from transpiler import Program

TOKEN = "s3cret-Token_123"
REFUSED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
PROBE = str(paths.SCRIPTS / "role_probe.py")


def build() -> Program:
    return Program(odd_mlp(dtype=torch.float64), "sgd", lr=0.1)


def train(cluster: LocalCluster, steps: int, security: Security = None) -> dict:
    """Each trainer runs ``steps`` sync steps on its share of the same batches; trainer 0's state."""
    data = batches(cluster.n_trainers, 4, steps, dtype=torch.float64)

    def body(tr, i):
        for step in data:
            x, y = step[i]
            nn.functional.cross_entropy(tr.model(x), y).backward()
            tr.step()
        return tr.state_dict()

    if security is None:
        return cluster.run_trainers(body)[0]
    with Trainer(cluster.transpiler(0).get_trainer_program(), security) as tr:
        return body(tr, 0)


def stats(endpoint: str, security: Security, timeout: float = 5.0) -> ps_pb2.StatsReply:
    ch = security.channel(endpoint)
    try:
        return ps_pb2_grpc.ParameterServerStub(ch).Stats(ps_pb2.StatsRequest(), timeout=timeout)
    finally:
        ch.close()


def raw_call(ch: grpc.Channel, path: str, client_streaming: bool, server_streaming: bool):
    """Call ``path`` with raw (empty) bytes in the method's own shape; returns its replies."""
    if client_streaming and server_streaming:
        return list(ch.stream_stream(path)(iter([b""]), timeout=5))
    if client_streaming:
        return ch.stream_unary(path)(iter([b""]), timeout=5)
    if server_streaming:
        return list(ch.unary_stream(path)(b"", timeout=5))
    return ch.unary_unary(path)(b"", timeout=5)


def registered_methods() -> set:
    """The ParameterServer methods the servicer registers (others answer UNIMPLEMENTED to anyone)."""

    class Recorder:
        def add_registered_method_handlers(self, service, handlers):
            self.service, self.handlers = service, handlers

    rec = Recorder()
    servicer().add_to_server(rec)
    assert rec.service == SERVICE_NAME
    service = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"]
    return {m.name for m in service.methods if m.name in rec.handlers}


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_test_certs(str(tmp_path_factory.mktemp("certs")))


# ---------------------------------------------------------------- the token


@pytest.mark.timeout(60)
def test_every_method_refuses_without_the_right_token():
    server_sec = Security(token=TOKEN)
    registered = registered_methods()
    assert {"Hello", "Pull", "PushPull", "PushPullOne", "Close", "Stats"} <= registered
    methods = [
        (f"/{SERVICE_NAME}/{m.name}", m.client_streaming, m.server_streaming, m.name in registered)
        for m in ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"].methods
    ]
    methods += [
        ("/grpc.health.v1.Health/Check", False, False, True),
        ("/grpc.health.v1.Health/Watch", False, True, True),
        ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", True, True, True),
    ]
    with LocalCluster(build, 1, 1, security=server_sec) as cluster:
        ep = cluster.endpoints[0]
        for ch in (grpc.insecure_channel(ep), Security(token="not-" + TOKEN).channel(ep)):
            with ch:
                for path, cs, ss, known in methods:
                    with pytest.raises(grpc.RpcError) as e:
                        raw_call(ch, path, cs, ss)
                    want = grpc.StatusCode.UNAUTHENTICATED if known else grpc.StatusCode.UNIMPLEMENTED
                    assert e.value.code() == want, (path, e.value.code(), e.value.details())
                    if known:
                        assert "PS_AUTH_TOKEN" in e.value.details()

        # Nothing was touched: no step, no push, no trainer registered.
        reply = stats(ep, server_sec)
        assert (reply.step, reply.pushes, list(reply.trainers_alive)) == (0, 0, [])
        # Health and reflection work with the token.
        with server_sec.channel(ep) as ch:
            raw_call(ch, "/grpc.health.v1.Health/Check", False, False)
        # A real trainer with the token pulls the startup values (into a zeroed model).
        program = cluster.transpiler(0).get_trainer_program()
        with torch.no_grad():
            for p in program.model.parameters():
                p.zero_()
        with Trainer(program, server_sec) as tr:
            expected = build().model.state_dict()
            got = tr.state_dict()
            assert all(torch.equal(got[k], expected[k]) for k in expected)


@pytest.mark.timeout(60)
def test_trainers_with_the_token_train_as_without():
    with LocalCluster(build, 2, 2) as plain:
        want = train(plain, 2)
    with LocalCluster(build, 2, 2, security=Security(token=TOKEN)) as cluster:
        got = train(cluster, 2)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-12)
    assert not torch.equal(want["fc1.weight"], build().model.state_dict()["fc1.weight"])


@pytest.mark.timeout(30)
def test_a_trainer_with_a_wrong_token_fails_fast_naming_it():
    with LocalCluster(build, 1, 1, security=Security(token=TOKEN)) as cluster:
        program = cluster.transpiler(0).get_trainer_program()
        with pytest.raises(Exception, match="auth token") as e:
            Trainer(program, Security(token="wrong"))
        assert (
            isinstance(e.value, PserverError)
            and e.value.kind == REFUSED_KIND
            and e.value.status == "UNAUTHENTICATED"
        )


# ---------------------------------------------------------------- TLS


@pytest.mark.timeout(60)
def test_tls_trains_and_refuses_plaintext(certs):
    server_sec = Security(tls_cert=certs["server_cert"], tls_key=certs["server_key"])
    client_sec = Security(tls_ca=certs["ca"])
    # The same job in plaintext, through the same Trainer path: TLS may change the channel only.
    with LocalCluster(build, 1, 1) as plain:
        want = train(plain, 2, Security())
    initial = build().model.state_dict()
    with LocalCluster(build, 1, 1, security=server_sec) as cluster:
        ep = cluster.endpoints[0]
        got = train(cluster, 2, client_sec)
        assert stats(ep, client_sec).step == 2
        assert set(got) == set(want) == set(initial)
        for k in want:
            assert torch.equal(got[k], want[k]), k
        assert not torch.equal(got["fc1.weight"], initial["fc1.weight"])  # it trained
        with pytest.raises(grpc.RpcError) as e:
            stats(ep, Security(), timeout=3)
        assert e.value.code() in REFUSED


@pytest.mark.timeout(60)
def test_mutual_tls_requires_a_client_certificate(certs):
    full = Security(
        tls_cert=certs["server_cert"],
        tls_key=certs["server_key"],
        tls_ca=certs["ca"],
        tls_client_cert=certs["client_cert"],
        tls_client_key=certs["client_key"],
    )
    with LocalCluster(build, 1, 1, security=full) as cluster:
        ep = cluster.endpoints[0]
        with pytest.raises(grpc.RpcError) as e:
            stats(ep, Security(tls_ca=certs["ca"]), timeout=3)
        assert e.value.code() in REFUSED
        # The server certificate is not a client certificate (no clientAuth usage).
        with pytest.raises(grpc.RpcError) as e:
            stats(
                ep,
                Security(
                    tls_ca=certs["ca"],
                    tls_client_cert=certs["server_cert"],
                    tls_client_key=certs["server_key"],
                ),
                timeout=3,
            )
        assert e.value.code() in REFUSED
        train(cluster, 1)
        assert stats(ep, full).step == 1


@pytest.mark.timeout(60)
def test_token_and_tls_together(certs):
    sec = Security(
        token=TOKEN,
        tls_cert=certs["server_cert"],
        tls_key=certs["server_key"],
        tls_ca=certs["ca"],
        tls_client_cert=certs["client_cert"],
        tls_client_key=certs["client_key"],
    )
    with LocalCluster(build, 2, 2, security=sec) as cluster:
        train(cluster, 1)
        wrong = Security(
            token="wrong",
            tls_ca=certs["ca"],
            tls_client_cert=certs["client_cert"],
            tls_client_key=certs["client_key"],
        )
        with pytest.raises(grpc.RpcError) as e:
            stats(cluster.endpoints[0], wrong)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert [stats(ep, sec).step for ep in cluster.endpoints] == [1, 1]


@pytest.mark.timeout(60)
def test_tls_server_name_override(tmp_path):
    paths = make_test_certs(str(tmp_path), hosts=["pserver.test"], days=1)
    server_sec = Security(tls_cert=paths["server_cert"], tls_key=paths["server_key"])
    with LocalCluster(build, 1, 1, security=server_sec) as cluster:
        ep = cluster.endpoints[0]
        with pytest.raises(grpc.RpcError) as e:  # 127.0.0.1 is not in the certificate
            stats(ep, Security(tls_ca=paths["ca"]), timeout=3)
        assert e.value.code() in REFUSED
        assert stats(ep, Security(tls_ca=paths["ca"], tls_server_name="pserver.test")).step == 0


@pytest.mark.timeout(30)
def test_cert_maker_cli(tmp_path, capsys):
    assert certs_main([str(tmp_path / "c"), "--hosts", "127.0.0.1,ps0.example", "--days", "2"]) == 0
    for name in ("ca.pem", "ca.key", "server.pem", "server.key", "client.pem", "client.key"):
        assert (tmp_path / "c" / name).is_file()
    assert stat.S_IMODE(os.stat(tmp_path / "c" / "server.key").st_mode) == 0o600
    assert "PS_TLS_CERT=" in capsys.readouterr().out
    assert certs_main([str(tmp_path / "c"), "--no-overwrite"]) == 2
    assert certs_main([str(tmp_path / "d"), "--days", "0"]) == 2


# ---------------------------------------------------------------- configuration errors


@pytest.mark.timeout(10)
def test_from_env(tmp_path, certs):
    token_file = tmp_path / "token"
    token_file.write_text(f"  {TOKEN}\n")
    assert Security.from_env({}) == Security()
    assert Security.from_env({"PS_AUTH_TOKEN_FILE": str(token_file)}).token == TOKEN
    assert Security.from_env({"PS_AUTH_TOKEN_FILE": str(token_file), "PS_AUTH_TOKEN": TOKEN}).token == TOKEN
    sec = Security.from_env(
        {
            "PS_TLS_CERT": certs["server_cert"],
            "PS_TLS_KEY": certs["server_key"],
            "PS_TLS_CA": certs["ca"],
            "PS_TLS_CLIENT_CERT": certs["client_cert"],
            "PS_TLS_CLIENT_KEY": certs["client_key"],
            "PS_TLS_SERVER_NAME": "x",
        }
    )
    assert (sec.tls_cert, sec.tls_ca, sec.tls_client_key, sec.tls_server_name) == (
        certs["server_cert"],
        certs["ca"],
        certs["client_key"],
        "x",
    )
    assert TOKEN not in repr(Security(token=TOKEN))


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "env, variable",
    [
        ({"PS_TLS_CERT": "{server_cert}"}, "PS_TLS_KEY"),
        ({"PS_TLS_KEY": "{server_key}"}, "PS_TLS_CERT"),
        ({"PS_TLS_CLIENT_CERT": "{client_cert}"}, "PS_TLS_CLIENT_KEY"),
        ({"PS_AUTH_TOKEN": "a", "PS_AUTH_TOKEN_FILE": "{token}"}, "PS_AUTH_TOKEN_FILE"),
        ({"PS_AUTH_TOKEN_FILE": "{missing}"}, "PS_AUTH_TOKEN_FILE"),
        ({"PS_TLS_CA": "{missing}"}, "PS_TLS_CA"),
        ({"PS_AUTH_TOKEN": ""}, "PS_AUTH_TOKEN"),
        ({"PS_AUTH_TOKEN_FILE": "{empty}"}, "PS_AUTH_TOKEN_FILE"),
        ({"PS_AUTH_TOKEN": "has space"}, "PS_AUTH_TOKEN"),
    ],
)
def test_from_env_errors_name_the_variable(env, variable, tmp_path, certs):
    (tmp_path / "token").write_text("b\n")
    (tmp_path / "empty").write_text("\n")
    paths = dict(
        certs,
        token=str(tmp_path / "token"),
        empty=str(tmp_path / "empty"),
        missing=str(tmp_path / "nope.pem"),
    )
    with pytest.raises(ValueError, match=variable):
        Security.from_env({k: v.format(**paths) for k, v in env.items()})


@pytest.mark.timeout(10)
def test_a_pserver_with_a_ca_but_no_certificate_is_refused(certs):
    with pytest.raises(ValueError, match="PS_TLS_CERT"):
        with LocalCluster(build, 1, 1, security=Security(tls_ca=certs["ca"])):
            pass


# ---------------------------------------------------------------- ps-launch


@pytest.mark.timeout(10)
def test_launch_auth_token_file_reaches_every_role(tmp_path, monkeypatch):
    monkeypatch.delenv("PS_AUTH_TOKEN", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "token").write_text(TOKEN + "\n")
    args = launch_plan.parse_args(
        ["--server_num", "2", "--worker_num", "2", "--auth_token_file", "token", PROBE]
    )
    roles = launch_plan.plan_roles(args, pick_ports=lambda n: [7300 + i for i in range(n)])
    assert len(roles) == 4
    for role in roles:
        env = child_env(role, base={"PS_AUTH_TOKEN_FILE": "/elsewhere", "PS_TLS_CA": "/ca.pem"})
        assert env["PS_AUTH_TOKEN_FILE"] == str(tmp_path / "token")
        assert env["PS_TLS_CA"] == "/ca.pem"  # the launcher's TLS settings pass through
        assert Security.from_env({k: v for k, v in env.items() if k != "PS_TLS_CA"}).token == TOKEN
    # Without the flag nothing is added.
    args = launch_plan.parse_args(["--server_num", "1", "--worker_num", "1", PROBE])
    assert all("PS_AUTH_TOKEN_FILE" not in r.env for r in launch_plan.plan_roles(args))
    for bad in ("missing", "empty"):
        if bad == "empty":
            (tmp_path / "empty").write_text("")
        args = launch_plan.parse_args(
            ["--server_num", "1", "--worker_num", "1", "--auth_token_file", bad, PROBE]
        )
        with pytest.raises(LaunchError, match="auth_token_file"):
            launch_plan.plan_roles(args)
