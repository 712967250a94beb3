"""bench_peers refuses, before any round runs, a chart it could not draw."""

import importlib.util

import pytest

from benchmarks import bench_peers

# What bench_peers reads of the peers' jobs.py (shared/peers/jobs.py, absent from a bare checkout).
JOBS = "S_STEPS, S_WARMUP, S_EVAL_N, S_BATCH, D_STEPS, D_WARMUP = 200, 20, 20000, 1024, 30, 5\n"


def test_a_chart_without_matplotlib_is_refused_before_the_rounds(monkeypatch, capsys, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a)
    )
    (tmp_path / "jobs.py").write_text(JOBS)
    peers = ["--peers", str(tmp_path)]
    with pytest.raises(SystemExit) as e:
        bench_peers.parse_args(["--rounds", "1", "--jobs", "S", *peers])
    assert e.value.code == 2
    assert "needs matplotlib" in capsys.readouterr().err
    # Without a chart, or for the scaling table (which draws none), the same machine may run it.
    assert bench_peers.parse_args(["--rounds", "1", "--jobs", "S", "--no-png", *peers]).png is None
    assert bench_peers.parse_args(["--scaling", "--rounds", "1", *peers]).scaling
