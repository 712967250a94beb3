"""bench_peers refuses, before any round runs, a chart it could not draw."""
import importlib.util

import pytest

from benchmarks import bench_peers


def test_a_chart_without_matplotlib_is_refused_before_the_rounds(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(SystemExit) as e:
        bench_peers.parse_args(["--rounds", "1", "--jobs", "S"])
    assert e.value.code == 2
    assert "needs matplotlib" in capsys.readouterr().err
    # Without a chart, or for the scaling table (which draws none), the same machine may run it.
    assert bench_peers.parse_args(["--rounds", "1", "--jobs", "S", "--no-png"]).png is None
    assert bench_peers.parse_args(["--scaling", "--rounds", "1"]).scaling
