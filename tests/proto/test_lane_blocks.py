"""Which lane carries which block: the rule both sides of a push-pull in lanes compute (lane_blocks)."""

import pytest

from psproto.lane_blocks import MAX_LANES, lane_of_blocks, split_by_lane


@pytest.mark.parametrize(
    "blocks,lanes,expected",
    [
        # one lane: everything in it
        ([("a", 5), ("b", 3)], 1, {"a": 0, "b": 0}),
        # largest first, each to the lightest lane (lowest on a tie)
        ([("a", 8), ("b", 8), ("c", 2), ("d", 2)], 2, {"a": 0, "b": 1, "c": 0, "d": 1}),
        ([("w", 16), ("b", 1), ("v", 4), ("u", 4), ("x", 4)], 2, {"w": 0, "v": 1, "u": 1, "x": 1, "b": 1}),
        # equal blocks: names break the tie, so the answer does not depend on their order
        ([("b", 4), ("a", 4), ("c", 4)], 3, {"a": 0, "b": 1, "c": 2}),
        # more lanes than blocks: the extra lanes carry nothing
        ([("a", 4)], 3, {"a": 0}),
        ([], 2, {}),
    ],
)
def test_lane_of_blocks(blocks, lanes, expected):
    assert lane_of_blocks(blocks, lanes) == expected
    assert lane_of_blocks(list(reversed(blocks)), lanes) == expected


def test_lanes_carry_balanced_bytes():
    blocks = [(f"p{i}.block{j}", (i + 1) * 1000 + j) for i in range(6) for j in range(3)]
    lane_of = lane_of_blocks(blocks, 4)
    load = [sum(n for name, n in blocks if lane_of[name] == k) for k in range(4)]
    assert max(load) - min(load) <= max(n for _, n in blocks)


@pytest.mark.parametrize("lanes", [0, -1, MAX_LANES + 1, 2.5, True])
def test_lane_counts_out_of_range_are_refused(lanes):
    with pytest.raises(ValueError, match="lanes must be"):
        lane_of_blocks([("a", 1)], lanes)


def test_split_by_lane_puts_other_names_in_lane_0():
    lane_of = {"fc.weight.block0": 1, "fc.weight.block1": 0}
    names = ["fc.weight.block0", "emb@ids", "fc.weight.block1", "emb@rows", "emb@next"]
    assert split_by_lane(names, lane_of, 2) == [[1, 2, 3, 4], [0]]
