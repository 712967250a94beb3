"""bench_veth across layouts: where each system's roles go, and the bytes a step must move between the
hosts."""

from __future__ import annotations

import pytest

from benchmarks import bench_veth
from benchmarks.common import veth_runs
from benchmarks.jobs.dense_workers import Spec, param_bytes
from harness.host_layouts import parse_layout

SPEC = Spec(sizes=(8, 16, 4), batch=4, lr=0.1, warmup=1, steps=2, sync_mode=True, timeout=10.0)
MODEL = param_bytes(SPEC.sizes)


@pytest.mark.parametrize(
    "layout,ps_share,ddp_on",
    [
        ("pair", 1.0, (1, 2)),  # every trainer-pserver pair crosses; DDP's ranks one per host
        ("split", 1.0, (3, 4)),
        ("colocated:2", 0.5, (1, 2)),  # half of each trainer's blocks are on its own host
    ],
)
def test_the_payload_between_hosts_follows_the_layout(layout, ps_share, ddp_on):
    lay = parse_layout(layout)
    for system in ("ps", "rpc"):
        assert bench_veth.payload_per_step(system, SPEC, lay) == pytest.approx(ps_share * 2 * 2 * MODEL)
    assert bench_veth.payload_per_step("ddp", SPEC, lay) == 2 * MODEL
    assert veth_runs.ddp_hosts(lay) == ddp_on


def test_a_narrow_push_moves_three_quarters():
    narrow = Spec(**{**SPEC.__dict__, "grad_wire_dtype": "bfloat16"})
    assert bench_veth.payload_per_step("ps", narrow, parse_layout("split")) == pytest.approx(2 * 1.5 * MODEL)


def test_loopback_runs_put_every_role_on_host_1():
    lo = veth_runs.placed(parse_layout("split"), "lo")
    assert (lo.pservers, lo.trainers) == ((1, 1), (1, 1))
    assert veth_runs.placed(parse_layout("split"), "veth") == parse_layout("split")


@pytest.mark.parametrize("layout", ["colocated", "split:1+2", "ring"])
def test_a_layout_with_other_role_counts_than_job_d_is_refused(layout, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_veth.parse_args(["--layout", layout, "--rounds", "1"])
    assert exit_.value.code == 2
    assert "layout" in capsys.readouterr().err
