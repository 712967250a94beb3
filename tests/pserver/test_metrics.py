"""Issue 13: Prometheus metrics of each pserver and the probe-only health port.

(Trainers' global metrics: tests/trainer/test_job_metrics.py.) Pure decisions (ports) are table-driven;
the rest runs real gRPC pservers on loopback in this process (LocalCluster),
and one test starts ``ps-server`` as a process to check the environment
variables a Kubernetes pod sets and the shutdown on SIGTERM.
"""

from __future__ import annotations

import argparse
import http.client
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from torch import nn

from harness.cluster import LocalCluster
from harness.models import batches, odd_mlp
from harness.ports import free_ports
from pserver import ParameterServer
from pserver.ops.health import HealthPort
from pserver.ops.ports import HEALTH_PORT_VAR, METRICS_PORT_VAR, SidePorts, port_setting, split_host
from psproto import ps_pb2, ps_pb2_grpc
from psproto.security import Security
from tests.helpers import paths
from tests.helpers.polling import poll
from transpiler import DistributeTranspiler, DistributeTranspilerConfig, Program
from transpiler.cli import add_transpile_arguments, config_from_args

REPO = str(paths.REPO)
TOKEN = "metrics-Token_42"
DEADLINE = 30.0


def build() -> Program:
    return Program(odd_mlp(), "sgd", lr=0.1)


# -- helpers -------------------------------------------------------------------------------------


def scrape(port: int) -> dict:
    """{(sample name, frozenset of labels but endpoint): value} from ``/metrics`` on 127.0.0.1:``port``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        assert r.status == 200
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset((k, v) for k, v in s.labels.items() if k != "endpoint"))] = s.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, frozenset(labels.items()))]


def health_status(port: int, metadata=(), service: str = "") -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return (
            health_pb2_grpc.HealthStub(ch)
            .Check(health_pb2.HealthCheckRequest(service=service), timeout=5, metadata=metadata)
            .status
        )


def train_steps(trainers, data) -> None:
    """Each trainer (already open) trains ``data`` in its own thread; both must finish."""
    errors = []

    def run(i, tr):
        try:
            for step in data:
                x, y = step[i]
                nn.functional.cross_entropy(tr.model(x), y).backward()
                tr.step()
        except BaseException as e:  # reported on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, tr)) for i, tr in enumerate(trainers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(DEADLINE)
    assert not any(th.is_alive() for th in threads), "training did not finish"
    assert not errors, errors


def connection_refused(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return False
    except OSError:
        return True


# -- ports: field, variable, conflicts --------------------------------------------------------


@pytest.mark.parametrize(
    "field, env, expected",
    [
        (None, {}, None),
        (None, {"V": ""}, None),
        (None, {"V": " 9090 "}, 9090),
        (None, {"V": "0"}, 0),
        (7000, {"V": "9090"}, 7000),  # the config field wins over the variable
        (0, {"V": "9090"}, 0),
    ],
)
def test_port_setting(field, env, expected):
    assert port_setting(field, "V", env) == expected


@pytest.mark.parametrize("text", ["http", "-1", "65536", "90 90", "9090.0"])
def test_port_setting_refuses_a_malformed_variable(text):
    with pytest.raises(ValueError, match=f"V={text!r}"):
        port_setting(None, "V", {"V": text})


@pytest.mark.parametrize(
    "metrics_port, health_port, env, match",
    [
        (6170, None, {}, "metrics port .* endpoint"),
        (None, None, {HEALTH_PORT_VAR: "6170"}, "health port .* endpoint"),
        (9090, None, {HEALTH_PORT_VAR: "9090"}, "both 9090"),
    ],
)
def test_side_ports_that_cannot_all_bind_are_refused(metrics_port, health_port, env, match):
    with pytest.raises(ValueError, match=match):
        SidePorts.resolve(metrics_port, health_port, "10.0.0.5:6170", env)


def test_side_ports_from_the_kubernetes_variables():
    env = {METRICS_PORT_VAR: "9090", HEALTH_PORT_VAR: "6171"}
    assert SidePorts.resolve(None, None, "10.0.0.5:6170", env) == SidePorts(9090, 6171)
    assert SidePorts.resolve(0, 0, "10.0.0.5:6170", env) == SidePorts(0, 0)  # two free ports: no clash
    assert split_host("[::1]:6170") == "::1" and split_host("ps-0.ps:6170") == "ps-0.ps"


@pytest.mark.parametrize(
    "field, bad",
    [
        ("metrics_port", -1),
        ("metrics_port", 70000),
        ("health_port", "6171"),
        ("health_port", True),
        ("metrics_port", 1.5),
    ],
)
def test_config_refuses_bad_ports(field, bad):
    with pytest.raises(ValueError, match=field):
        DistributeTranspilerConfig(**{field: bad})


def test_ps_server_flags_set_the_ports():
    parser = argparse.ArgumentParser()
    add_transpile_arguments(parser)
    cfg = config_from_args(parser.parse_args(["--metrics_port", "9090", "--health_port", "6171"]))
    assert (cfg.metrics_port, cfg.health_port) == (9090, 6171)
    assert config_from_args(parser.parse_args([])).metrics_port is None


# -- /metrics during a job ----------------------------------------------------------------------


def test_metrics_move_during_a_sync_job():
    cfg = DistributeTranspilerConfig(metrics_port=0)
    with LocalCluster(build, 2, 2, config=cfg) as cluster:
        ports = [s.metrics_port for s in cluster.servers]
        assert all(ports) and len(set(ports)) == 2
        first = scrape(ports[0])
        assert value(first, "ps_step") == 0 and value(first, "ps_pushes_total") == 0
        assert value(first, "ps_layout_epoch") == 0 and value(first, "ps_routing_version") == 2
        assert value(first, "ps_trainers", state="alive") == 0
        assert value(first, "ps_trainers_expected") == 2
        assert value(first, "ps_pserver_info", mode="sync", shard="0", pservers="2", trainers="2") == 1
        assert value(first, "ps_checkpoint_step") == -1
        assert ("ps_checkpoint_age_seconds", frozenset()) not in first
        assert value(first, "process_resident_memory_bytes") > 0

        trainers = [cluster.trainer(i) for i in range(2)]
        try:
            data = batches(2, 4, 6)
            train_steps(trainers, data[:3])
            mid = [scrape(p) for p in ports]
            train_steps(trainers, data[3:])
            late = [scrape(p) for p in ports]
        finally:
            for tr in trainers:
                tr.close()
        for a, b in zip(mid, late):
            assert value(a, "ps_step") == 3 and value(b, "ps_step") == 6
            assert value(a, "ps_trainers", state="alive") == 2 == value(b, "ps_trainers", state="alive")
            assert value(b, "ps_pushes_total") == 12 > value(a, "ps_pushes_total") == 6
            assert value(b, "ps_received_bytes_total") > value(a, "ps_received_bytes_total") > 0
            assert value(b, "ps_sent_bytes_total") > value(a, "ps_sent_bytes_total") > 0
            assert value(b, "ps_trainer_pushes_total", trainer="1") == 6
            assert value(b, "ps_block_bytes") > 0
            # Sync: the first trainer to push each step waited for the other.
            assert value(b, "ps_barrier_wait_seconds_count") >= value(a, "ps_barrier_wait_seconds_count") > 0
            assert value(b, "ps_barrier_wait_seconds_bucket", le="+Inf") == value(
                b, "ps_barrier_wait_seconds_count"
            )
        closed = scrape(ports[0])
        assert (
            value(closed, "ps_trainers", state="closed") == 2
            and value(closed, "ps_trainers", state="alive") == 0
        )

        # A refused request is counted by its reason and status.
        with grpc.insecure_channel(cluster.endpoints[0]) as ch:
            with pytest.raises(grpc.RpcError) as e:
                ps_pb2_grpc.ParameterServerStub(ch).Hello(ps_pb2.HelloRequest(trainer_id=7), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        refused = scrape(ports[0])
        assert value(refused, "ps_refused_requests_total", reason="BadRequest", code="INVALID_ARGUMENT") == 1
        # ps-stat's Stats RPC still answers, with the same numbers.
        with grpc.insecure_channel(cluster.endpoints[0]) as ch:
            stats = ps_pb2_grpc.ParameterServerStub(ch).Stats(ps_pb2.StatsRequest(), timeout=5)
        assert stats.step == 6 and stats.pushes == 12 and stats.refused == 1
    for port in ports:  # the metrics servers stopped with their pservers
        assert connection_refused(port)


def test_async_metrics_and_a_checkpoint(tmp_path):
    cfg = DistributeTranspilerConfig(metrics_port=0, checkpoint_dir=str(tmp_path / "ckpt"))
    with LocalCluster(build, 1, 1, sync_mode=False, config=cfg) as cluster:
        data = batches(1, 4, 2)
        with cluster.trainer(0) as tr:
            before = time.time()
            train_steps([tr], data)
            tr.checkpoint()
            got = scrape(cluster.servers[0].metrics_port)
            after = time.time()
        assert value(got, "ps_pserver_info", mode="async", shard="0", pservers="1", trainers="1") == 1
        assert value(got, "ps_step") == 2 and value(got, "ps_checkpoint_step") == 2
        # The checkpoint was written while the test watched (the pserver runs in this process, same clock).
        assert before <= value(got, "ps_checkpoint_timestamp_seconds") <= after
        assert 0 <= value(got, "ps_checkpoint_age_seconds") <= after - before
        assert value(got, "ps_barrier_wait_seconds_count") == 0  # async trainers never wait for each other


def test_metrics_port_from_the_environment_and_auth_refusals(monkeypatch):
    port, taken = free_ports(2)
    monkeypatch.setenv(METRICS_PORT_VAR, str(port))
    with LocalCluster(build, 1, 1, security=Security(token=TOKEN)) as cluster:
        assert cluster.servers[0].metrics_port == port and cluster.servers[0].health_port is None
        with grpc.insecure_channel(cluster.endpoints[0]) as ch:  # no token
            with pytest.raises(grpc.RpcError) as e:
                ps_pb2_grpc.ParameterServerStub(ch).Stats(ps_pb2.StatsRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert value(scrape(port), "ps_refused_requests_total", reason="auth", code="UNAUTHENTICATED") == 1
    # The config field wins over the variable.
    with LocalCluster(build, 1, 1, config=DistributeTranspilerConfig(metrics_port=taken)) as cluster:
        assert cluster.servers[0].metrics_port == taken
        assert value(scrape(taken), "ps_step") == 0
    monkeypatch.setenv(METRICS_PORT_VAR, "nine")
    with pytest.raises(ValueError, match=f"{METRICS_PORT_VAR}='nine'"):
        LocalCluster(build, 1, 1).__enter__()


def test_a_metrics_port_in_use_fails_the_start_and_leaves_no_port_open():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        (health,) = free_ports(1)
        cfg = DistributeTranspilerConfig(metrics_port=port, health_port=health)
        t = DistributeTranspiler(cfg)
        endpoint = f"127.0.0.1:{free_ports(1)[0]}"
        t.transpile(0, program=build(), pservers=endpoint, trainers=1)
        prog = t.get_pserver_program(endpoint)
        server = ParameterServer(prog, t.get_startup_program(endpoint, prog), security=Security())
        with pytest.raises(OSError, match=f"metrics port 127.0.0.1:{port}"):
            server.start()
        assert connection_refused(health) and connection_refused(int(endpoint.rsplit(":", 1)[1]))
        server.stop()


# -- the health port ----------------------------------------------------------------------------


def test_health_port_answers_without_the_token_that_the_main_port_requires():
    cfg = DistributeTranspilerConfig(health_port=0)
    with LocalCluster(build, 2, 1, config=cfg, security=Security(token=TOKEN)) as cluster:
        server = cluster.servers[0]
        port = server.health_port
        assert port and port != cluster.servers[1].health_port
        serving = health_pb2.HealthCheckResponse.SERVING
        assert health_status(port) == serving
        assert health_status(port, service="psproto.ParameterServer") == serving
        main = int(cluster.endpoints[0].rsplit(":", 1)[1])
        with pytest.raises(grpc.RpcError) as e:
            health_status(main)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert health_status(main, metadata=[("authorization", f"Bearer {TOKEN}")]) == serving
        # Nothing but health on the health port: the training service is not there.
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.RpcError) as e:
                ps_pb2_grpc.ParameterServerStub(ch).Stats(ps_pb2.StatsRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        server.stop()
        with pytest.raises(grpc.RpcError) as e:
            health_status(port)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert health_status(cluster.servers[1].health_port) == serving


def test_health_port_states():
    hp = HealthPort("127.0.0.1", 0, ("", "psproto.ParameterServer"))
    port = hp.start()
    try:
        assert health_status(port) == health_pb2.HealthCheckResponse.NOT_SERVING  # not ready yet
        hp.serving()
        assert (
            health_status(port, service="psproto.ParameterServer") == health_pb2.HealthCheckResponse.SERVING
        )
        hp.shutting_down()
        assert health_status(port) == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        hp.stop()
    assert connection_refused(port)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(OSError, match="health port 127.0.0.1:"):
            HealthPort("127.0.0.1", busy.getsockname()[1]).start()


# -- ps-server as Kubernetes runs it ------------------------------------------------------------


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_ps_server_process_reads_the_pod_variables_and_stops_on_sigterm(tmp_path):
    main, metrics_port, health_port = free_ports(3)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "PS_", "TRAINING_"))}
    env.update(
        TRAINING_ROLE="PSERVER",
        PADDLE_PSERVERS_IP_PORT_LIST=f"127.0.0.1:{main}",
        PADDLE_TRAINERS_NUM="1",
        POD_IP="127.0.0.1",
        PADDLE_PORT=str(main),
        PS_AUTH_TOKEN=TOKEN,
        PS_METRICS_PORT=str(metrics_port),
        PS_HEALTH_PORT=str(health_port),
        PYTHONUNBUFFERED="1",
    )
    log = tmp_path / "pserver.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pserver.cli", "--program", "examples/train_mlp.py:build_program"],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:

        def serving():
            if proc.poll() is not None:
                raise AssertionError(f"ps-server exited with {proc.returncode}:\n{log.read_text()}")
            try:
                return health_status(health_port) == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                return False

        poll(serving, "the health port answers SERVING", timeout=90)
        got = scrape(metrics_port)
        assert value(got, "ps_step") == 0 and value(got, "ps_trainers_expected") == 1
        with pytest.raises(grpc.RpcError) as e:
            health_status(main)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(DEADLINE) == 0, log.read_text()
        assert connection_refused(metrics_port) and connection_refused(health_port)
        assert "Prometheus metrics at http://127.0.0.1:" in log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_metrics_are_prometheus_text_on_the_endpoints_host_only():
    with LocalCluster(build, 1, 1, config=DistributeTranspilerConfig(metrics_port=0)) as cluster:
        port = cluster.servers[0].metrics_port
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        try:
            conn.request("GET", "/metrics")
            r = conn.getresponse()
            body = r.read().decode()
        finally:
            conn.close()
        assert r.status == 200 and r.getheader("Content-Type").startswith("text/plain")
        assert "# TYPE ps_pushes_total counter" in body and "# TYPE ps_barrier_wait_seconds histogram" in body
        # Bound to the endpoint's host (127.0.0.1), not to every address: 127.0.0.2 finds no one.
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(f"http://127.0.0.2:{port}/metrics", timeout=2)
