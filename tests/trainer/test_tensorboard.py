"""What jobs write to TensorBoard, read back with TensorBoard's own reader (EventAccumulator).

- the CTR example under ``ps-launch --tensorboard_dir`` (2 pservers x 2 trainers, two tables) writes
  every tag docs/tensorboard.md lists for pserver mode, and nothing else, with sane values;
- an in-process sync job with a disk tier and eviction, every trainer writing: each has its run,
  trainer 0 alone the pservers' tags, whose last values equal the pservers' own counts;
- a collective trainer writes its step split (``step_time/optimizer_ms``).

The hot-standby tag (``replication_lag``) is read back from the replicated job of
tests/replication/test_launch.py.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # the test extra has it
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from harness.cluster import LocalCluster
from tests.helpers import paths
from tests.helpers.table_models import table_batches, table_program
from trainer.collective import CollectiveTrainer
from transpiler import DistributeTranspiler, DistributeTranspilerConfig, Program

REPO = paths.REPO
DOC = REPO / "docs" / "tensorboard.md"
STEPS, EVERY, BATCH, METRICS_EVERY = 24, 5, 256, 10


def read_run(directory) -> dict:
    """{tag: [(step, value)]} of one run (a trainer's subdirectory), as TensorBoard reads it."""
    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def documented_tags() -> list:
    """The tag column of docs/tensorboard.md's "What is written" table."""
    section = DOC.read_text().split("## What is written", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([^`]+)` \|", section, flags=re.M)


def expand(template: str, script: list, jobs: dict, pservers: int, tables: list) -> set:
    """A documented tag with its placeholders filled in for one job."""
    if template == "<tag>":
        return set(script)
    if template.startswith("job/"):
        return {f"job/{name}" for name in jobs[template]}
    names = {template}
    if "<k>" in template:
        names = {n.replace("<k>", str(k)) for n in names for k in range(pservers)}
    if "<table>" in template:
        names = {n.replace("<table>", t) for n in names for t in tables}
    return names


def assert_steps_increase(run: dict) -> None:
    for tag, points in run.items():
        steps = [s for s, _ in points]
        assert steps == sorted(set(steps)), (tag, steps)


# ---------------------------------------------------------------- the CTR example under ps-launch


@pytest.mark.processes
@pytest.mark.timeout(180)
def test_the_ctr_example_writes_every_documented_tag_with_sane_values(tmp_path):
    board = tmp_path / "tb"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "PS_", "TRAINING_"))}
    env["PS_TENSORBOARD_EVERY"] = str(EVERY)
    cmd = [
        sys.executable,
        "-m",
        "trainer.launch",
        "--server_num",
        "2",
        "--worker_num",
        "2",
        "--show",
        "trainer0",
        "--tensorboard_dir",
        str(board),
        "--log_dir",
        str(tmp_path / "log"),
        str(REPO / "examples" / "train_ctr.py"),
        "--train_examples",
        "40000",
        "--test_examples",
        "4000",
        "--steps",
        str(STEPS),
        "--batch_size",
        str(BATCH),
        "--metrics_every",
        str(METRICS_EVERY),
        "--no_save",
        "--no_progress",
        "--target_auc",
        "0",
    ]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    printed = float(re.search(r"test AUC ([0-9.]+) after (\d+) steps", done.stdout)[1])

    assert sorted(p.name for p in board.iterdir()) == ["trainer-0"]  # trainer 0 alone writes by default
    run = read_run(board / "trainer-0")
    pserver_mode = [
        t for t in documented_tags() if t not in ("step_time/optimizer_ms", "pserver<k>/replication_lag")
    ]
    expected = set().union(
        *(
            expand(
                t,
                ["loss", "test_auc"],
                {"job/<name>": ["train_auc"], "job/<name>_<op>": ["loss_mean"]},
                2,
                ["wide", "deep"],
            )
            for t in pserver_mode
        )
    )
    assert set(run) == expected
    assert_steps_increase(run)

    periodic = [s for s, _ in run["throughput/steps_per_s"]]
    assert periodic == list(range(EVERY, STEPS + 1, EVERY)) + [STEPS]  # and once more as the trainer closes
    assert [s for s, _ in run["loss"]] == [10, 20]  # the script logs it every 10 steps
    assert all(0 < v < 2 and math.isfinite(v) for _, v in run["loss"])
    for (step, rate), (_, examples) in zip(run["throughput/steps_per_s"], run["throughput/examples_per_s"]):
        assert rate > 0 and examples == pytest.approx(BATCH * rate, rel=1e-4), step
    assert all(v > 0 for tag in ("step_time/compute_ms", "step_time/push_pull_ms") for _, v in run[tag])
    assert [s for s, _ in run["job/train_auc"]] == [10, 20]
    assert all(0.5 < v <= 1 for _, v in run["job/train_auc"]) and all(
        0 < v < 2 for _, v in run["job/loss_mean"]
    )
    assert run["test_auc"] == [(STEPS, pytest.approx(printed, abs=5e-5))]
    for k in (0, 1):
        applied = run[f"pserver{k}/applied_step"]
        assert all(v in (s, s + 1) for s, v in applied)  # sync: trainer 0's next push may already be applied
        assert applied[-1] == (STEPS, STEPS)
        assert all(v > 0 for _, v in run[f"pserver{k}/pushes_per_s"])
        for table in ("wide", "deep"):
            rows = [v for _, v in run[f"pserver{k}/rows_in_memory/{table}"]]
            assert rows[0] > 0 and rows == sorted(rows)  # new ids only join: no eviction configured
            assert {v for _, v in run[f"pserver{k}/rows_on_disk/{table}"]} == {0.0}
            assert {v for _, v in run[f"pserver{k}/evictions/{table}"]} == {0.0}


# ---------------------------------------------------------------- every trainer, disk tier, eviction


@pytest.mark.timeout(90)
def test_every_trainer_writes_its_run_and_trainer_0_the_pservers_counts(tmp_path):
    rules = {"ram_rows": 6, "evict_unseen_steps": 3}
    build = lambda: table_program("sgd", tables={"emb": {"lifecycle": rules}, "bag": None}, lr=0.3)  # noqa: E731
    data = table_batches(2, 6, 9, seed=2)
    config = DistributeTranspilerConfig(
        table_disk_dir=str(tmp_path / "disk"),
        tensorboard_dir=str(tmp_path / "tb"),
        tensorboard_trainers="all",
        tensorboard_every=4,
    )
    with LocalCluster(build, 2, 2, config=config) as cluster:

        def body(tr, i):
            for step_batches in data:
                ids, bag, y = step_batches[i]
                loss = nn.functional.cross_entropy(tr.model(ids, bag), y)
                loss.backward()
                tr.step()
                tr.log_scalars({"loss": loss})  # a one-element tensor, at the trainer's step

        cluster.run_trainers(body)
        shards = [s.engine.tables.shards for s in cluster.servers]
        held = [
            {t: (sh[t].rows_held - sh[t].disk_rows, sh[t].disk_rows, sh[t].life.counts.evicted) for t in sh}
            for sh in shards
        ]

    runs = {p.name: read_run(p) for p in (tmp_path / "tb").iterdir()}
    assert sorted(runs) == ["trainer-0", "trainer-1"]
    for name, run in runs.items():
        assert_steps_increase(run)
        assert [s for s, _ in run["loss"]] == list(range(1, 10))
        assert all(math.isfinite(v) for _, v in run["loss"])
        assert [s for s, _ in run["throughput/steps_per_s"]] == [4, 8, 9]
        assert all(v > 0 for _, v in run["throughput/steps_per_s"])
        assert "throughput/examples_per_s" not in run  # batches not from tr.batches() are not counted
    assert not any(t.startswith("pserver") for t in runs["trainer-1"])  # the Stats are trainer 0's job alone
    pserver_tags = {t for t in runs["trainer-0"] if t.startswith("pserver")}
    assert pserver_tags == {
        f"pserver{k}/{what}"
        for k in (0, 1)
        for what in (
            "applied_step",
            "pushes_per_s",
            "rows_in_memory/emb",
            "rows_on_disk/emb",
            "evictions/emb",
            "rows_in_memory/bag",
            "rows_on_disk/bag",
            "evictions/bag",
        )
    }
    last = {t: points[-1] for t, points in runs["trainer-0"].items()}
    for k, counts in enumerate(held):  # the last round, as trainer 0 closed, is what the pservers hold
        for table, (in_memory, on_disk, evicted) in counts.items():
            assert last[f"pserver{k}/rows_in_memory/{table}"] == (9, in_memory)
            assert last[f"pserver{k}/rows_on_disk/{table}"] == (9, on_disk)
            assert last[f"pserver{k}/evictions/{table}"] == (9, evicted)
    assert (
        sum(c["emb"][1] for c in held) > 0 and sum(c["emb"][2] for c in held) > 0
    )  # the tags saw real values


# ---------------------------------------------------------------- collective mode


@pytest.mark.timeout(60)
def test_a_collective_trainer_writes_its_optimizer_time_and_throughput(tmp_path):
    torch.manual_seed(0)
    config = DistributeTranspilerConfig(
        mode="collective", tensorboard_dir=str(tmp_path / "tb"), tensorboard_every=3
    )
    t = DistributeTranspiler(config)
    t.transpile(0, program=Program(nn.Linear(4, 2), "sgd", lr=0.1), pservers=None, trainers=1)
    data = TensorDataset(torch.randn(80, 4), torch.randint(0, 2, (80,)))
    with CollectiveTrainer(t.get_trainer_program()) as tr:
        for x, y in tr.batches(DataLoader(data, batch_size=8, sampler=tr.sampler(data, shuffle=False)), 1):
            loss = nn.functional.cross_entropy(tr.model(x), y)
            loss.backward()
            tr.step()
            tr.log_scalars({"loss": loss.item()})
    run = read_run(tmp_path / "tb" / "trainer-0")
    assert set(run) == {
        "loss",
        "throughput/steps_per_s",
        "throughput/examples_per_s",
        "step_time/compute_ms",
        "step_time/optimizer_ms",
    }
    assert [s for s, _ in run["step_time/optimizer_ms"]] == [3, 6, 9, 10]
    for (_, rate), (_, examples) in zip(run["throughput/steps_per_s"], run["throughput/examples_per_s"]):
        assert examples == pytest.approx(8 * rate, rel=1e-4)
