"""bench_hosts' table (ratios to TorchRec round by round) and its refusals of bad input, with no hosts
made."""

from __future__ import annotations

import pytest

from benchmarks import bench_hosts


def run(system, rnd, examples_s, link="unshaped", layout="split"):
    return {
        "system": system,
        "round": rnd,
        "examples_s": examples_s,
        "link": link,
        "layout": layout,
        "auc": 0.77,
        "wire_bytes_per_example": 4000.0,
        "other_load": 0.01,
    }


def test_the_table_gives_medians_and_each_rounds_ratio_to_torchrec_per_link_and_layout():
    rows = [
        run("torchrec", 0, 40000),
        run("ours-sync", 0, 30000),
        run("torchrec", 1, 20000),
        run("ours-sync", 1, 30000),
        run("torchrec", 2, 30000),
        run("ours-sync", 2, 33000),
        run("torchrec", 0, 10000, link="1gbit"),
        run("ours-sync", 0, 12000, link="1gbit"),
        run("torchrec", 0, 20000, layout="colocated"),
        run("ours-sync", 0, 10000, layout="colocated"),
    ]
    lines = bench_hosts.table(rows).splitlines()
    assert len(lines) == 2 + 6
    sync = next(line for line in lines if "| unshaped | split | ours-sync" in line)
    assert "30,000 [30,000-33,000]" in sync and "0.75, 1.50, 1.10: **1.10x**" in sync
    slow = next(line for line in lines if "| 1gbit | split | ours-sync" in line)
    assert "1.20: **1.20x**" in slow
    colocated = next(line for line in lines if "| unshaped | colocated | ours-sync" in line)
    assert "0.50: **0.50x**" in colocated
    assert lines.index(sync) < lines.index(slow) < lines.index(colocated)  # in the order they ran


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--layouts", "ring"], "a layout is"),
        (["--systems", "ours-sync,paddle"], "systems of"),
        (["--rounds", "0", "--systems", "ours-sync"], "--rounds"),
        (["--layouts", "split:1+3", "--systems", "ours-sync"], "divide the global batch"),
        (
            ["--systems", "ours-sync,paddle-async", "--paddle-python", "/nonexistent/python"],
            "setup_paddle.sh",
        ),
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_hosts.parse_args(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
