"""Issue 13: Prometheus metrics of each pserver, the probe-only health port, and trainers' global metrics.

Pure decisions (ports, reductions, AUC from histograms) are table-driven;
the rest runs real gRPC pservers on loopback in this process (LocalCluster),
and one test starts ``ps-server`` as a process to check the environment
variables a Kubernetes pod sets and the shutdown on SIGTERM.
"""
from __future__ import annotations

import argparse
import http.client
import math
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
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from sklearn.metrics import roc_auc_score
from torch import nn

from pserver import ParameterServer
from pserver.errors import BadRequest, NotAllowed
from pserver.ops.health import HealthPort
from pserver.ops.ports import HEALTH_PORT_VAR, METRICS_PORT_VAR, SidePorts, port_setting, split_host
from pserver.engine.reductions import MAX_OPEN, Rounds, combine, to_values
from psproto import ps_pb2, ps_pb2_grpc
from psproto.security import Security
from tests.helpers.cluster import LocalCluster
from tests.helpers.models import batches, odd_mlp, odd_program
from tests.helpers.ports import free_ports
from trainer import PserverError, job_metrics
from trainer.job_metrics import AucStats, auc_from_histograms
from transpiler import DistributeTranspiler, DistributeTranspilerConfig, Program
from transpiler.cliargs import add_transpile_arguments, config_from_args

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                    timeout=5, metadata=metadata).status


def poll(ready, what: str, timeout: float = DEADLINE):
    deadline = time.monotonic() + timeout
    while True:
        got = ready()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout}s")
        time.sleep(0.05)


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


def in_parallel(cluster: LocalCluster, body, ids=None) -> dict:
    return cluster.run_trainers(body, ids=ids, timeout=DEADLINE)


def connection_refused(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return False
    except OSError:
        return True


# -- ports: field, variable, conflicts --------------------------------------------------------

@pytest.mark.parametrize("field, env, expected", [
    (None, {}, None),
    (None, {"V": ""}, None),
    (None, {"V": " 9090 "}, 9090),
    (None, {"V": "0"}, 0),
    (7000, {"V": "9090"}, 7000),        # the config field wins over the variable
    (0, {"V": "9090"}, 0),
])
def test_port_setting(field, env, expected):
    assert port_setting(field, "V", env) == expected


@pytest.mark.parametrize("text", ["http", "-1", "65536", "90 90", "9090.0"])
def test_port_setting_refuses_a_malformed_variable(text):
    with pytest.raises(ValueError, match=f"V={text!r}"):
        port_setting(None, "V", {"V": text})


@pytest.mark.parametrize("metrics_port, health_port, env, match", [
    (6170, None, {}, "metrics port .* endpoint"),
    (None, None, {HEALTH_PORT_VAR: "6170"}, "health port .* endpoint"),
    (9090, None, {HEALTH_PORT_VAR: "9090"}, "both 9090"),
])
def test_side_ports_that_cannot_all_bind_are_refused(metrics_port, health_port, env, match):
    with pytest.raises(ValueError, match=match):
        SidePorts.resolve(metrics_port, health_port, "10.0.0.5:6170", env)


def test_side_ports_from_the_kubernetes_variables():
    env = {METRICS_PORT_VAR: "9090", HEALTH_PORT_VAR: "6171"}
    assert SidePorts.resolve(None, None, "10.0.0.5:6170", env) == SidePorts(9090, 6171)
    assert SidePorts.resolve(0, 0, "10.0.0.5:6170", env) == SidePorts(0, 0)  # two free ports: no clash
    assert split_host("[::1]:6170") == "::1" and split_host("ps-0.ps:6170") == "ps-0.ps"


@pytest.mark.parametrize("field, bad", [("metrics_port", -1), ("metrics_port", 70000), ("health_port", "6171"),
                                        ("health_port", True), ("metrics_port", 1.5)])
def test_config_refuses_bad_ports(field, bad):
    with pytest.raises(ValueError, match=field):
        DistributeTranspilerConfig(**{field: bad})


def test_ps_server_flags_set_the_ports():
    parser = argparse.ArgumentParser()
    add_transpile_arguments(parser)
    cfg = config_from_args(parser.parse_args(["--metrics_port", "9090", "--health_port", "6171"]))
    assert (cfg.metrics_port, cfg.health_port) == (9090, 6171)
    assert config_from_args(parser.parse_args([])).metrics_port is None


# -- reductions: pure bookkeeping ---------------------------------------------------------------

V = lambda *xs: {"v": np.array(xs, dtype=np.float64)}  # noqa: E731


@pytest.mark.parametrize("op, expected", [("sum", [6.5, -1.0]), ("max", [4.0, 2.0]), ("min", [0.5, -5.0])])
def test_combine(op, expected):
    parts = {2: V(4.0, 2.0), 0: V(2.0, 2.0), 1: V(0.5, -5.0)}
    assert combine(op, parts)["v"].tolist() == expected


def test_combine_is_in_trainer_id_order_whatever_the_arrival():
    rng = np.random.default_rng(3)
    values = {t: {"v": rng.normal(size=1000) * 10.0 ** rng.integers(-8, 8, size=1000)} for t in range(5)}
    reference = combine("sum", values)["v"]
    for order in ([4, 3, 2, 1, 0], [2, 0, 4, 1, 3]):
        assert combine("sum", {t: values[t] for t in order})["v"].tobytes() == reference.tobytes()


@pytest.mark.parametrize("items, match", [
    ([], "at least one"),
    ([("", [1], [1.0])], "needs a name"),
    ([("a", [1], [1.0]), ("a", [1], [1.0])], "twice"),
    ([("a", [2, 2], [1.0, 2.0])], "needs 4 numbers, got 2"),
    ([("a", [-1], [])], "negative"),
])
def test_to_values_refuses(items, match):
    with pytest.raises(BadRequest, match=match):
        to_values(items)


def test_to_values_shapes():
    got = to_values([("pos", [2, 3], range(6)), ("n", [], [7.0])])
    assert got["pos"].shape == (2, 3) and got["pos"][1, 2] == 5.0 and got["n"].shape == () and float(got["n"]) == 7.0


def snapshot(r: Rounds):
    return ({k: (v.op, v.shapes, {t: {n: a.tolist() for n, a in p.items()} for t, p in v.parts.items()})
             for k, v in r.open.items()}, {k: (d[0], {n: a.tolist() for n, a in d[1].items()}, d[2])
                                          for k, d in r.done.items()})


def test_a_round_finishes_once_every_expected_trainer_sent_its_values():
    r = Rounds("ep")
    r.add(1, "k", 0, "sum", V(1.0))
    assert r.result("k", 0, {0, 1}) is None and r.missing("k", 0, {0, 1}) == [0]
    r.add(1, "k", 0, "sum", V(2.0))                    # a retry replaces the values
    r.add(0, "k", 0, "sum", V(10.0))
    values, who = r.result("k", 0, {0, 1})
    assert values["v"].tolist() == [12.0] and who == (0, 1) and not r.open
    r.add(0, "k", 0, "sum", V(10.0))                   # a retry after the end: answered again
    assert r.result("k", 0, {0, 1})[0]["v"].tolist() == [12.0]
    r.add(0, "k", 1, "sum", V(5.0))                    # trainer 1 closed: not waited for
    assert r.result("k", 1, {0})[0]["v"].tolist() == [5.0]


@pytest.mark.parametrize("call, error, match", [
    (lambda r: r.add(0, "", 1, "sum", V(1.0)), BadRequest, "key"),
    (lambda r: r.add(0, "x" * 201, 1, "sum", V(1.0)), BadRequest, "key"),
    (lambda r: r.add(0, "k", 1, "mean", V(1.0)), BadRequest, "op"),
    (lambda r: r.add(0, "k", -1, "sum", V(1.0)), BadRequest, "round"),
    (lambda r: r.add(0, "k", 1, "max", V(1.0)), BadRequest, "'max' in round 1 .* others for 'sum'"),
    (lambda r: r.add(0, "k", 1, "sum", V(1.0, 2.0)), BadRequest, r"v \[2\] .* others sent v \[1\]"),
    (lambda r: r.add(0, "k", 1, "sum", {"w": np.ones(1)}), BadRequest, "others sent v"),
    (lambda r: r.add(2, "done", 0, "sum", V(1.0)), NotAllowed, "round 0 .* is over"),
    (lambda r: r.add(0, "old", 0, "sum", V(1.0)), NotAllowed, r"round 0 .* is over \(round 1 finished"),
])
def test_bad_contributions_are_refused_and_change_nothing(call, error, match):
    r = Rounds("ep")
    r.add(1, "k", 1, "sum", V(1.0))
    r.add(0, "done", 0, "sum", V(1.0))
    r.result("done", 0, {0})
    r.add(0, "old", 0, "sum", V(1.0))
    r.result("old", 0, {0})
    r.add(0, "old", 1, "sum", V(1.0))
    r.result("old", 1, {0})
    before = snapshot(r)
    with pytest.raises(error, match=match):
        call(r)
    assert snapshot(r) == before


def test_open_rounds_are_bounded_and_withdrawn_ones_go():
    r = Rounds("ep")
    for i in range(MAX_OPEN):
        r.add(0, f"k{i}", 0, "sum", V(1.0))
    with pytest.raises(NotAllowed, match="open already"):
        r.add(0, "one-more", 0, "sum", V(1.0))
    r.withdraw(0, "k0", 0)
    assert ("k0", 0) not in r.open
    r.add(0, "one-more", 0, "sum", V(1.0))


# -- AUC from histograms ------------------------------------------------------------------------

def test_auc_from_histograms_equals_sklearn_when_buckets_hold_exact_ties():
    rng = np.random.default_rng(0)
    n = 200
    buckets = rng.integers(0, 100, size=2000)
    scores = (buckets + 0.5) / 100.0                   # bucket centres: one score per bucket, exact ties
    labels = (rng.random(2000) < 0.2 + 0.6 * scores).astype(int)
    stats = AucStats(100)
    stats.update(labels[:n], scores[:n])
    stats.update(labels[n:], scores[n:])
    assert stats.auc() == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)


@pytest.mark.parametrize("pos, neg, expected", [
    ([0, 0, 3], [3, 0, 0], 1.0),
    ([3, 0, 0], [0, 0, 3], 0.0),
    ([2, 0], [2, 0], 0.5),
    ([1, 1], [0, 0], math.nan),
    ([], [], math.nan),
])
def test_auc_from_histograms_table(pos, neg, expected):
    got = auc_from_histograms(np.array(pos), np.array(neg))
    assert (math.isnan(got) and math.isnan(expected)) or got == expected


@pytest.mark.parametrize("labels, scores, match", [
    ([0, 2], [0.1, 0.2], "labels must be 0 or 1"),
    ([0, 1], [0.1, 1.2], r"in \[0, 1\]"),
    ([0, 1], [0.1, float("nan")], r"in \[0, 1\]"),
    ([0, 1, 1], [0.1, 0.2], "same number"),
])
def test_auc_stats_refuse_bad_input_and_add_nothing(labels, scores, match):
    stats = AucStats(10)
    stats.update([1], [0.5])
    with pytest.raises(ValueError, match=match):
        stats.update(labels, scores)
    assert stats.pos.sum() == 1 and stats.neg.sum() == 0


# -- /metrics during a job ----------------------------------------------------------------------

def test_metrics_move_during_a_sync_job():
    cfg = DistributeTranspilerConfig(metrics_port=0)
    with LocalCluster(build, 2, 2, config=cfg) as cluster:
        ports = [s.metrics_port for s in cluster.servers]
        assert all(ports) and len(set(ports)) == 2
        first = scrape(ports[0])
        assert value(first, "ps_step") == 0 and value(first, "ps_pushes_total") == 0
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
            assert value(b, "ps_barrier_wait_seconds_bucket", le="+Inf") == value(b, "ps_barrier_wait_seconds_count")
        closed = scrape(ports[0])
        assert value(closed, "ps_trainers", state="closed") == 2 and value(closed, "ps_trainers", state="alive") == 0

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
        assert stats.updates == 6 and stats.pushes == 12 and stats.refused == 1
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
        assert health_status(port, service="psproto.ParameterServer") == health_pb2.HealthCheckResponse.SERVING
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


# -- global metrics -----------------------------------------------------------------------------

def test_global_metrics_equal_the_pooled_values():
    rng = np.random.default_rng(5)
    # Different data, and a different amount of it, on each trainer.
    labels = [rng.integers(0, 2, size=n) for n in (300, 500)]
    scores = [np.clip(0.3 * y + rng.random(len(y)) * 0.7, 0, 1) for y in labels]
    quantized = [(np.minimum(np.floor(s * 4095), 4094) + 0.5) / 4095 for s in scores]  # bucket centres
    losses = [rng.random(len(y)) for y in labels]

    def body(tr, i):
        stats = AucStats()
        half = len(labels[i]) // 2
        stats.update(torch.from_numpy(labels[i][:half]), torch.from_numpy(scores[i][:half]))
        stats.update(labels[i][half:], scores[i][half:])
        return (job_metrics.global_auc(tr, stats=stats),
                job_metrics.global_auc(tr, labels[i], quantized[i], name="exact"),
                job_metrics.global_mean(tr, "loss", losses[i].mean(), weight=len(losses[i])),
                job_metrics.global_sum(tr, "n", len(labels[i])),
                job_metrics.global_sum(tr, "hist", np.bincount(labels[i], minlength=2)),
                job_metrics.global_max(tr, "worst", losses[i].max()),
                job_metrics.global_min(tr, "best", losses[i].min()),
                job_metrics.global_mean(tr, "loss", losses[i].mean(), weight=len(losses[i])))  # round 1

    with LocalCluster(build, 2, 2, config=DistributeTranspilerConfig(barrier_timeout=DEADLINE)) as cluster:
        got = in_parallel(cluster, body)
    assert repr(got[0]) == repr(got[1])  # the very same numbers on every trainer
    auc, exact, mean, n, hist, worst, best, again = got[0]
    all_labels, all_scores = np.concatenate(labels), np.concatenate(scores)
    assert auc == pytest.approx(roc_auc_score(all_labels, all_scores), abs=1.0 / 4095)
    assert exact == pytest.approx(roc_auc_score(all_labels, np.concatenate(quantized)), abs=1e-12)
    assert local_auc_differs(labels, scores, auc)
    assert mean == pytest.approx(np.concatenate(losses).mean(), rel=1e-12) and again == mean
    assert n == 800.0 and isinstance(n, float)
    assert hist.tolist() == np.bincount(all_labels, minlength=2).tolist()
    assert worst == max(x.max() for x in losses) and best == min(x.min() for x in losses)


def local_auc_differs(labels, scores, auc) -> bool:
    """Each trainer's own AUC differs from the job's: the helper is not trainer 0's local view."""
    return all(abs(roc_auc_score(y, s) - auc) > 1e-4 for y, s in zip(labels, scores))


def test_a_closed_trainer_is_not_waited_for_and_a_missing_one_times_out():
    cfg = DistributeTranspilerConfig(barrier_timeout=3.0, heartbeat_timeout=60.0)
    with LocalCluster(build, 1, 3, config=cfg) as cluster:
        trainers = [cluster.trainer(i) for i in range(3)]
        try:
            trainers[2].close()
            got = {}
            threads = [threading.Thread(target=lambda i=i: got.update({i: job_metrics.global_sum(trainers[i], "x", i + 1)}))
                       for i in range(2)]
            for th in threads:
                th.start()
            for th in threads:
                th.join(DEADLINE)
            assert got == {0: 3.0, 1: 3.0}
            # Trainer 1 does not come: trainer 0's next round fails after barrier_timeout, naming it. It waited
            # the whole barrier_timeout (the pserver's deadline starts after `started`); that the pserver's
            # barrier ended the wait, not the trainer's RPC deadline, the message shows (it names trainer 1).
            started = time.monotonic()
            with pytest.raises(PserverError, match=r"round 1 of reduction 'sum:x' still waits for trainers \[1\]"):
                job_metrics.global_sum(trainers[0], "x", 1.0)
            assert time.monotonic() - started >= cfg.barrier_timeout
            # Shapes that do not match the round's are refused; the round goes on.
            errors = []

            def late():
                try:
                    got["late"] = job_metrics.global_sum(trainers[0], "x", 10.0)
                except PserverError as e:
                    errors.append(e)
            th = threading.Thread(target=late)
            th.start()
            poll(lambda: cluster.servers[0].reductions.open_rounds(), "trainer 0 opens round 1")
            with pytest.raises(PserverError, match=r"INVALID_ARGUMENT.*others sent v \[\]"):
                job_metrics.global_sum(trainers[1], "x", [1.0, 2.0])
            assert job_metrics.global_sum(trainers[1], "x", 5.0) == 15.0
            th.join(DEADLINE)
            assert not errors and got["late"] == 15.0
        finally:
            for tr in trainers:
                tr.close()


def test_all_reduce_refuses_bad_input_before_any_call():
    class NoCalls:
        comm = object()

    for kwargs, match in [(dict(op="mean"), "op"), (dict(key=""), "key"), (dict(round=-1), "round"),
                          (dict(values={}), "at least one"), (dict(values={"a": "x"}), "number")]:
        args = dict(key="k", values={"a": 1.0}) | kwargs
        with pytest.raises(ValueError, match=match):
            job_metrics.all_reduce(NoCalls(), **args)
    with pytest.raises(ValueError, match="weight"):
        job_metrics.global_mean(NoCalls(), "m", 1.0, weight=-1)
    with pytest.raises(ValueError, match="labels and scores, or stats"):
        job_metrics.global_auc(NoCalls(), [1])


# -- ps-server as Kubernetes runs it ------------------------------------------------------------

@pytest.mark.processes
@pytest.mark.timeout(120)
def test_ps_server_process_reads_the_pod_variables_and_stops_on_sigterm(tmp_path):
    main, metrics_port, health_port = free_ports(3)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "PS_", "TRAINING_"))}
    env.update(TRAINING_ROLE="PSERVER", PADDLE_PSERVERS_IP_PORT_LIST=f"127.0.0.1:{main}", PADDLE_TRAINERS_NUM="1",
               POD_IP="127.0.0.1", PADDLE_PORT=str(main), PS_AUTH_TOKEN=TOKEN,
               PS_METRICS_PORT=str(metrics_port), PS_HEALTH_PORT=str(health_port), PYTHONUNBUFFERED="1")
    log = tmp_path / "pserver.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pserver.cli", "--program",
                                 "examples/train_mlp.py:build_program"],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
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


def collective_sums() -> tuple:
    from trainer import CollectiveTrainer

    t = DistributeTranspiler(DistributeTranspilerConfig(mode="collective", barrier_timeout=60))
    t.transpile(0, program=build(), pservers=None, trainers=1)
    with CollectiveTrainer(t.get_trainer_program()) as tr:
        return (job_metrics.global_sum(tr, "n", 3), job_metrics.global_mean(tr, "m", 2.0, weight=4),
                job_metrics.global_auc(tr, [0, 1, 1], [0.2, 0.9, 0.1]))


def test_collective_trainers_reduce_among_themselves():
    n, mean, auc = collective_sums()
    assert (n, mean) == (3.0, 2.0) and auc == pytest.approx(roc_auc_score([0, 1, 1], [0.2, 0.9, 0.1]))


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_a_trainer_node_combines_its_local_ranks_first(tmp_path):
    """Node 0 (2 local processes) and trainer 1 (one process): the job's sum counts every process once."""
    import multiprocessing

    from tests.helpers.metrics_node import node_rank
    from tests.helpers.nodes import stop, wait_all

    ctx = multiprocessing.get_context("spawn")
    with LocalCluster(odd_program, 1, 2, config=DistributeTranspilerConfig(barrier_timeout=DEADLINE)) as cluster:
        (port,) = free_ports(1)
        outs = [str(tmp_path / f"rank{r}.pt") for r in range(2)]
        procs = [ctx.Process(target=node_rank, args=(odd_program, cluster.endpoints, r, port, outs[r], DEADLINE))
                 for r in range(2)]
        for p in procs:
            p.start()
        try:
            got = in_parallel(cluster, lambda tr, i: (job_metrics.global_sum(tr, "n", 100.0),
                                                      job_metrics.global_max(tr, "m", -1)), ids=[1])
            assert wait_all(procs) == [0, 0]
        finally:
            stop(procs)
    assert got[1] == (111.0, 1.0)
    assert [torch.load(o) for o in outs] == [(111.0, 1.0)] * 2
