"""Slurm's compressed lists as transpiler.roles.slurm_lists reads them: node lists expanded in Slurm's own
order (unsorted brackets and pieces kept), tasks per node, the block layout of tasks over nodes, and the
errors that name the variable (RoleEnv.from_env on whole Slurm steps:
tests/transpiler/test_role_discovery.py)."""

from __future__ import annotations

import re

import pytest

from transpiler.roles.slurm_lists import block_layout, expand_nodelist, tasks_per_node


@pytest.mark.parametrize(
    "text, nodes",
    [
        ("node[01-04,07],gpu[1-2]", ["node01", "node02", "node03", "node04", "node07", "gpu1", "gpu2"]),
        ("gpu[12,03-04]", ["gpu12", "gpu03", "gpu04"]),  # unsorted inside brackets
        ("b01,a[3,1]", ["b01", "a3", "a1"]),  # unsorted pieces
        ("rack[2,1]-n[09-10]", ["rack2-n09", "rack2-n10", "rack1-n09", "rack1-n10"]),
        ("c1.cluster.local,c[0010-0011]", ["c1.cluster.local", "c0010", "c0011"]),
        ("login", ["login"]),
    ],
)
def test_node_lists_expand_in_slurms_order(text, nodes):
    assert expand_nodelist(text, "SLURM_STEP_NODELIST") == nodes


@pytest.mark.parametrize(
    "text",
    ["", "n[1-3", "n[1]]", "n[3-1]", "a,,b", "n[a-b]", "n[1-4/2]", "@all", "n[]", "n 1", "n[[1]]", "n[1,1]"],
)
def test_bad_node_lists(text):
    with pytest.raises(ValueError, match=re.escape("SLURM_JOB_NODELIST=")):
        expand_nodelist(text, "SLURM_JOB_NODELIST")


@pytest.mark.parametrize(
    "text, counts", [("2(x3),1", [2, 2, 2, 1]), ("4", [4]), ("1,2,1(x2)", [1, 2, 1, 1]), (" 3(x2) ", [3, 3])]
)
def test_tasks_per_node(text, counts):
    assert tasks_per_node(text, "SLURM_STEP_TASKS_PER_NODE") == counts


@pytest.mark.parametrize("text", ["", "0", "2(x0)", "2(x)", "x2", "2,,1", "-1"])
def test_bad_tasks_per_node(text):
    with pytest.raises(ValueError, match=re.escape("SLURM_STEP_TASKS_PER_NODE=")):
        tasks_per_node(text, "SLURM_STEP_TASKS_PER_NODE")


def test_block_layout():
    assert block_layout(["b", "a"], [2, 1]) == [("b", 0), ("b", 1), ("a", 0)]
