"""Roles placed on hosts (harness/host_layouts.py), the per-host ps-launch recipe, and link
shaping."""

from __future__ import annotations

import pytest

from harness.host_layouts import endpoints, parse_layout, per_host_commands
from harness.netns import NetnsError, shaping_qdisc


@pytest.mark.parametrize(
    "text,pservers,trainers,hosts",
    [
        ("split", (1, 2), (3, 4), 4),
        ("split:1+3", (1,), (2, 3, 4), 4),
        ("split:4+8", (1, 2, 3, 4), (5, 6, 7, 8, 9, 10, 11, 12), 12),
        ("colocated", (1, 2, 3, 4), (1, 2, 3, 4), 4),
        ("colocated:2", (1, 2), (1, 2), 2),
        ("colocated:1", (1,), (1,), 1),
        ("pair", (1, 1), (2, 2), 2),
    ],
)
def test_a_layout_places_pservers_and_trainers_on_hosts(text, pservers, trainers, hosts):
    layout = parse_layout(text)
    assert (layout.pservers, layout.trainers, layout.hosts) == (pservers, trainers, hosts)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "split:2",
        "split:0+2",
        "split:2+0",
        "colocated:0",
        "colocated:2+2",
        "ring",
        "split:a+b",
        "split 2+2",
    ],
)
def test_a_malformed_layout_is_refused_naming_the_forms(text):
    with pytest.raises(ValueError, match="split|colocated"):
        parse_layout(text)


def ip(host: int) -> str:
    return f"10.0.0.{host}"


def test_split_hosts_run_only_their_own_roles_from_one_cluster_description():
    layout = parse_layout("split")
    assert [layout.roles_on(h) for h in (1, 2, 3, 4)] == [([0], []), ([1], []), ([], [0]), ([], [1])]
    cmds = per_host_commands(
        layout, ip, 6170, lambda h: f"log/h{h}", ["train.py", "--async"], launcher=["ps-launch"]
    )
    assert cmds[3] == [
        "ps-launch",
        "--servers",
        "10.0.0.1:6170,10.0.0.2:6171",
        "--workers",
        "10.0.0.3,10.0.0.4",
        "--host",
        "10.0.0.3",
        "--log_dir",
        "log/h3",
        "train.py",
        "--async",
    ]
    # Every host describes the same cluster; only --host and --log_dir differ.
    cluster = {tuple(c[:5]) + tuple(c[9:]) for c in cmds.values()}
    assert len(cluster) == 1 and sorted(cmds) == [1, 2, 3, 4]


def test_colocated_hosts_each_run_a_pserver_and_a_trainer():
    layout = parse_layout("colocated:3")
    assert [layout.roles_on(h) for h in (1, 2, 3)] == [([0], [0]), ([1], [1]), ([2], [2])]
    assert endpoints(layout, ip, 7000) == ["10.0.0.1:7000", "10.0.0.2:7001", "10.0.0.3:7002"]
    assert sorted(per_host_commands(layout, ip, 7000, str, ["t.py"])) == [1, 2, 3]


def test_a_host_with_no_role_runs_no_launcher():
    layout = parse_layout("split:1+1")
    assert sorted(per_host_commands(layout, ip, 7000, str, ["t.py"])) == [1, 2]


@pytest.mark.parametrize(
    "rate,delay,netem,qdisc",
    [
        (None, None, True, []),
        ("10gbit", None, True, ["netem", "rate", "10gbit"]),
        ("1gbit", "0.5ms", True, ["netem", "rate", "1gbit", "delay", "0.5ms"]),
        (None, "0.1ms", True, ["netem", "delay", "0.1ms"]),
        ("10gbit", None, False, ["tbf", "rate", "10gbit", "burst", str(1_250_000), "latency", "50ms"]),
        ("1gbit", None, False, ["tbf", "rate", "1gbit", "burst", str(512 * 1024), "latency", "50ms"]),
    ],
)
def test_a_link_is_shaped_by_netem_or_by_a_token_bucket_without_it(rate, delay, netem, qdisc):
    assert shaping_qdisc(rate, delay, netem) == qdisc


@pytest.mark.parametrize("rate,delay", [(None, "0.1ms"), ("fast", None)])
def test_what_a_token_bucket_cannot_shape_is_refused(rate, delay):
    with pytest.raises(NetnsError):
        shaping_qdisc(rate, delay, netem=False)
