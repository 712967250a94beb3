"""bench_lanes' arithmetic: how a move is cut into lanes and chunks, link rates, the report's ratios."""

import pytest

from benchmarks.bench_lanes import chunk_sizes, configurations, key, lane_bytes, link_bytes_per_s, report


@pytest.mark.parametrize(
    "total,lanes,expected",
    [
        (10, 1, [10]),
        (10, 2, [5, 5]),
        (10, 3, [4, 3, 3]),
        (2, 4, [2, 0, 0, 0]),
        (0, 2, [0, 0]),
    ],
)
def test_lane_bytes_share_the_move(total, lanes, expected):
    assert lane_bytes(total, lanes) == expected
    assert sum(lane_bytes(total, lanes)) == total


@pytest.mark.parametrize(
    "total,chunk,expected", [(10, 4, [4, 4, 2]), (8, 4, [4, 4]), (3, 4, [3]), (0, 4, [])]
)
def test_chunk_sizes_cut_a_lane(total, chunk, expected):
    assert chunk_sizes(total, chunk) == expected


def test_bad_cuts_are_refused():
    with pytest.raises(ValueError):
        lane_bytes(10, 0)
    with pytest.raises(ValueError):
        chunk_sizes(10, 0)


@pytest.mark.parametrize(
    "link,expected", [("unshaped", None), ("1gbit", 125e6), ("10gbit", 1.25e9), ("500mbit", 62.5e6)]
)
def test_link_rates(link, expected):
    assert link_bytes_per_s(link) == expected


def test_link_rate_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="unshaped or a rate"):
        link_bytes_per_s("fast")


def test_configurations_cover_both_modes_every_lane_count_and_chunk():
    configs = configurations([1, 2], [1024, 4096])
    assert len(configs) == 8
    assert {(c["mode"], c["lanes"], c["chunk"]) for c in configs} == {
        (m, n, c) for m in ("turns", "duplex") for n in (1, 2) for c in (1024, 4096)
    }


def test_report_compares_with_one_lane_and_the_link():
    one = {"mode": "turns", "lanes": 1, "chunk": 1 << 20}
    two = {**one, "lanes": 2}
    table = report("1gbit", {key(one): [50.0, 60.0, 55.0], key(two): [66.0, 66.0, 66.0]})
    assert "| turns lanes=1 chunk=1024KiB | 55 [50-60] | 1.00 | 44% |" in table
    assert "| turns lanes=2 chunk=1024KiB | 66 [66-66] | 1.20 | 53% |" in table
