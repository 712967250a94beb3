"""The GPU check (``benchmarks/gpu_check.sh``): its dry run here, and its pure logic table-driven.

This machine has no GPU, so the script makes a dry run: it must say so, name every stage, find
each ready (imports, command line, plan, the CUDA tests collected) and exit 0. The table, the
outcome of the CUDA tests from pytest's output, the exit status and the wheel list are pure
functions, checked case by case.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from benchmarks.gpu_check import report, stages, wheels, worker
from benchmarks.gpu_check.report import FAIL, PASS, READY, StageResult
from benchmarks.gpu_check.worker import compare_states
from tests.helpers.paths import REPO


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is what a machine without a GPU does")
@pytest.mark.timeout(90)
def test_the_script_s_dry_run_names_every_stage_finds_each_ready_and_exits_0(tmp_path):
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "PS_SITE": str(tmp_path / "site"),
        "OUT": str(tmp_path / "out"),
    }
    done = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_check.sh")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=80,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "No GPU here" in done.stdout
    for stage in stages.STAGES:
        assert f"| {stage.key} {stage.name} | ready |" in done.stdout
    written = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert written["mode"] == "dry-run" and written["summary"] == f"{len(stages.STAGES)} ready"
    assert [s["key"] for s in written["stages"]] == [s.key for s in stages.STAGES] == list("abcdef")
    assert next(s for s in written["stages"] if s["key"] == "a")["figures"]["collected"] >= 2
    assert "| stage | result | figures | seconds |" in (tmp_path / "out" / "gpu_check.md").read_text()
    # The script maps the import name psproto to proto/, as installing the project would.
    assert os.path.realpath(tmp_path / "site" / "psproto") == str(REPO / "proto")


def test_a_stage_whose_worker_dies_without_a_result_fails_and_points_at_its_log(tmp_path):
    broken = stages.Stage(
        "x", "broken", "a worker that does not exist", "benchmarks.gpu_check.no_such_stage", 30, 30
    )
    result = stages.run_stage(broken, "cpu", str(tmp_path), quick=True, budget_left=60)
    assert result.outcome == FAIL and "no result (exit 1)" in result.note and "x-broken.log" in result.note
    assert (
        "No module named benchmarks.gpu_check.no_such_stage"
        in (tmp_path / "logs" / "x-broken.log").read_text()
    )


def test_a_stage_is_not_started_without_the_time_to_run(tmp_path):
    result = stages.run_stage(
        stages.STAGES[1], "cuda", str(tmp_path), quick=False, budget_left=stages.MIN_STAGE_S - 1
    )
    assert result.outcome == FAIL and result.note.startswith("not run: 19 s left of the budget")
    assert not (tmp_path / "logs").exists()


def test_a_stage_that_cannot_be_planned_fails_the_dry_run_naming_why(tmp_path):
    broken = stages.Stage(
        "x", "broken", "a worker that does not exist", "benchmarks.gpu_check.no_such_stage", 1, 1
    )
    result = stages.dry_check(broken, "cuda", str(tmp_path))
    assert result.outcome == FAIL and "no_such_stage" in result.note
    assert report.exit_code([result], "dry-run") == 1


def test_without_the_peers_jobs_the_dry_run_finds_jobs_d_and_s_ready_and_says_their_plan_was_not_built(
    tmp_path, monkeypatch
):
    """A checkout without ../shared/peers (CI's): stages d and e import and parse; their jobs travel in
    .whl/peers."""
    monkeypatch.setattr(worker, "DEFAULT_PEERS", str(tmp_path / "shared" / "peers"))
    monkeypatch.setattr(worker, "CARRIED_PEERS", str(tmp_path / ".whl" / "peers"))
    with pytest.raises(worker.PeersMissing, match="--fetch-wheels"):
        worker.jobs_module()
    for stage in stages.select("d,e"):
        result = stages.dry_check(stage, "cuda", str(tmp_path))
        assert result.outcome == READY and result.figures == {"jobs": "not here"}
        assert result.note.startswith("plan not built: PeersMissing: no jobs.py in")
    assert report.exit_code([result], "dry-run") == 0


@pytest.mark.parametrize(
    "keys, expected",
    [
        (None, list("abcdef")),
        ("a", ["a"]),
        ("e,b", ["b", "e"]),
        (" c , d ", ["c", "d"]),
    ],
)
def test_stages_are_selected_by_key_in_the_check_s_order(keys, expected):
    assert [s.key for s in stages.select(keys)] == expected


def test_an_unknown_stage_is_refused_by_name():
    with pytest.raises(ValueError, match=r"unknown stage\(s\) \['z'\]"):
        stages.select("a,z")


def test_each_stage_s_command_runs_its_worker_on_the_device_asked_for():
    cuda_tests = stages.command(stages.STAGES[0], "cuda")
    assert cuda_tests[1:] == [
        "-m",
        "pytest",
        "-q",
        "-n",
        "0",
        "-p",
        "no:cacheprovider",
        "tests/trainer/test_cuda.py",
    ]
    b = stages.command(stages.STAGES[1], "cpu", "/r.json", quick=True)
    assert b[1:] == [
        "-m",
        "benchmarks.gpu_check.pserver_stage",
        "--device",
        "cpu",
        "--quick",
        "--result",
        "/r.json",
    ]
    assert stages.child_env("cpu")[
        "CUDA_VISIBLE_DEVICES"
    ] == "" and "CUDA_VISIBLE_DEVICES" not in stages.child_env("cuda")


@pytest.mark.parametrize(
    "outcomes, mode, code",
    [
        ([PASS] * 6, "cuda", 0),
        ([PASS, PASS, FAIL, PASS, PASS, PASS], "cuda", 1),
        ([PASS] * 6, "cpu", 0),
        ([READY] * 6, "dry-run", 0),
        ([READY, FAIL], "dry-run", 1),
        ([READY] * 2, "cuda", 1),  # a run whose stages did not run did not pass
        ([PASS] * 2, "dry-run", 1),
        ([], "cuda", 1),  # no stage checked nothing
    ],
)
def test_the_exit_status_is_0_only_when_every_stage_came_out_as_the_mode_expects(outcomes, mode, code):
    results = [StageResult(chr(ord("a") + i), "s", o) for i, o in enumerate(outcomes)]
    assert report.exit_code(results, mode) == code


def test_an_unknown_outcome_or_mode_is_refused():
    with pytest.raises(ValueError, match="outcome"):
        StageResult("a", "s", "passed")
    with pytest.raises(ValueError, match="mode"):
        report.exit_code([StageResult("a", "s", PASS)], "gpu")


@pytest.mark.parametrize(
    "value, shown",
    [
        (0.5, "0.5"),
        (1234.5678, "1235"),
        (65536.0, "65536"),
        (3.0e-7, "3.00e-07"),
        (0.0, "0"),
        (2.5e6, "2.50e+06"),
        (0.02345678, "0.02346"),
        (7, "7"),
        (True, "yes"),
        (False, "no"),
        ("nccl", "nccl"),
        (["cuda:0", 3], "[cuda:0 3]"),
        (math.nan, "nan"),
    ],
)
def test_figures_are_shown_short(value, shown):
    assert report.format_value(value) == shown


def test_the_table_has_a_row_per_stage_with_its_figures_note_and_seconds():
    results = [
        StageResult("a", "cuda-tests", PASS, {"passed": 2}, 31.04),
        StageResult("b", "pserver", FAIL, {"max_abs_diff": 0.25}, 12.0, "trainer 1: fc1.weight | outside"),
        StageResult("c", "node", FAIL, {}, 0.0, "not run: 3 s left"),
    ]
    assert report.markdown_table(results).splitlines() == [
        "| stage | result | figures | seconds |",
        "|---|---|---|---|",
        "| a cuda-tests | pass | passed=2 | 31.0 |",
        "| b pserver | fail | max_abs_diff=0.25; trainer 1: fc1.weight / outside | 12.0 |",
        "| c node | fail | not run: 3 s left | 0.0 |",
    ]
    assert report.summary(results) == "1 pass, 2 fail"
    written = json.loads(report.report_json(results, {"mode": "cuda"}))
    assert written["mode"] == "cuda" and written["summary"] == "1 pass, 2 fail"
    assert written["stages"][1] == {
        "key": "b",
        "name": "pserver",
        "outcome": FAIL,
        "figures": {"max_abs_diff": 0.25},
        "seconds": 12.0,
        "note": "trainer 1: fc1.weight | outside",
    }
    assert "- mode: cuda" in report.report_markdown(results, {"mode": "cuda"})


@pytest.mark.parametrize(
    "output, counts",
    [
        ("..\n2 passed in 31.20s\n", {"passed": 2}),
        (
            "F.\n=== short test summary info ===\n1 failed, 1 passed, 3 warnings in 40.1s\n",
            {"failed": 1, "passed": 1, "warning": 3},
        ),
        ("ss\n2 skipped in 0.50s\n", {"skipped": 2}),
        ("E\n1 error in 2.00s\n", {"error": 1}),
        (
            "log: 5 passed earlier\n========== 1 passed, 1 skipped in 3.3s ==========\n",
            {"passed": 1, "skipped": 1},
        ),
        ("Traceback: the run died\n", {}),
    ],
)
def test_pytest_s_closing_line_gives_the_counts(output, counts):
    assert report.pytest_counts(output) == counts


@pytest.mark.parametrize(
    "counts, rc, device, passed",
    [
        ({"passed": 2}, 0, "cuda", True),
        ({"passed": 1, "failed": 1}, 1, "cuda", False),
        ({"skipped": 2}, 0, "cuda", False),  # on a GPU machine, skipped CUDA tests mean torch saw no GPU
        ({"passed": 1, "skipped": 1}, 0, "cuda", False),
        ({"skipped": 2}, 0, "cpu", True),  # on the CPU they are skipped by design
        ({"passed": 2}, 1, "cuda", False),  # pytest's exit status counts too
        ({"error": 1}, 1, "cpu", False),
        ({}, 2, "cuda", False),
    ],
)
def test_the_cuda_tests_pass_only_when_they_ran_on_the_gpu_and_none_failed(counts, rc, device, passed):
    assert report.pytest_outcome(counts, rc, device) is passed


@pytest.mark.parametrize(
    "output, n",
    [
        ("tests/trainer/test_cuda.py::test_a\n\n2 tests collected in 1.2s\n", 2),
        ("1 test collected in 0.3s\n", 1),
        ("3/5 tests collected (2 deselected) in 1s\n", 3),
        ("error\n", -1),
    ],
)
def test_the_collected_count_is_read_from_pytest_s_line(output, n):
    assert report.collected_count(output) == n


def test_states_compare_within_the_cpu_tests_tolerance_and_name_the_first_key_outside():
    a = {"w": torch.ones(3), "b": torch.zeros(2)}
    assert compare_states(a, {"w": torch.ones(3) + 5e-6, "b": torch.zeros(2)}) == (
        True,
        pytest.approx(5e-6, rel=1e-2),
        "",
    )
    ok, worst, key = compare_states(a, {"w": torch.ones(3), "b": torch.tensor([0.0, 1e-3])})
    assert (ok, key) == (False, "b") and worst == pytest.approx(1e-3)
    assert compare_states(a, {"w": torch.ones(3)})[0] is False


def test_the_wheels_carried_are_the_project_s_runtime_and_test_needs_less_what_the_gpu_machine_has():
    names = wheels.requirement_names((REPO / "pyproject.toml").read_text())
    assert {"grpcio", "protobuf", "clustershell", "lmdb", "etcd3gw", "pytest-timeout", "torch"} <= set(names)
    carried = wheels.closure([n for n in names if n not in wheels.NOT_CARRIED], wheels.NOT_CARRIED)
    assert {
        "grpcio",
        "protobuf",
        "grpcio-health-checking",
        "clustershell",
        "pyyaml",
        "lmdb",
        "etcd3gw",
        "futurist",
        "requests",
        "pytest-timeout",
    } <= set(carried)
    assert not {"torch", "numpy", "numba", "pytest", "scikit-learn"} & set(carried)
    command = wheels.download_command(carried, "/d")
    assert command[3:6] == ["download", "--only-binary=:all:", "--python-version"] and "--no-deps" in command
    assert f"grpcio=={carried['grpcio']}" in command


@pytest.mark.parametrize(
    "name, canonical",
    [
        ("ClusterShell", "clustershell"),
        ("prometheus_client", "prometheus-client"),
        ("zope.interface", "zope-interface"),
    ],
)
def test_distribution_names_compare_as_pip_compares_them(name, canonical):
    assert wheels.canonical(name) == canonical


def test_the_torch_requirement_admits_the_gpu_machine_s_build():
    """The GPU machine's CUDA torch was 2.11 when last read: the project must not ask for another."""
    from packaging.requirements import Requirement

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = next(r for r in map(Requirement, dependencies) if r.name == "torch")
    assert spec.specifier.contains("2.11.0") and spec.specifier.contains("2.13.0")
