"""Collective ("nccl2") mode: DDP among trainer processes, no pservers.

Multi-process runs use torch.multiprocessing (spawn) with gloo on 127.0.0.1;
``mp.spawn`` terminates the other processes when one fails, so nothing is left
behind. Each worker saves its final parameters; the test compares them with
single-process training on the concatenated batches (tests/helpers/collective_runs.py).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from harness.models import batches, odd_mlp
from harness.ports import free_ports
from tests.helpers import paths
from tests.helpers.collective_runs import (
    NODE_VARS,
    PER_PROCESS,
    STEPS,
    amp_worker,
    assert_close,
    bf16_reference,
    collective_program,
    program,
    reference,
    spawn_training,
)
from trainer import PserverTrainer, Trainer
from trainer.collective import CollectiveTrainer
from transpiler import DistributeTranspiler, DistributeTranspilerConfig, Program, TrainerProgram

REPO = str(paths.REPO)
sys.path.insert(0, os.path.join(REPO, "examples"))
from train_mlp import TARGET_ACCURACY  # noqa: E402


@pytest.fixture(scope="module")
def four_processes(tmp_path_factory):
    """2 trainer nodes x 2 local processes, three runs in one spawn (starting processes is the slow part)."""
    return spawn_training(
        tmp_path_factory.mktemp("four"),
        2,
        2,
        {
            # ranks and rendezvous from torchrun's variables; small buckets so several all-reduces run
            "plain": ("momentum", True, dict(bucket_cap_mb=0.05)),
            "local_sgd_1": ("momentum", False, dict(use_local_sgd=True, local_sgd_steps=1)),
            "local_sgd_3": (
                "momentum",
                False,
                dict(use_local_sgd=True, local_sgd_steps=3, local_sgd_warmup_steps=1),
            ),
        },
    )


@pytest.fixture(autouse=True)
def _no_inherited_node_vars(monkeypatch):
    """Spawned workers inherit this environment: no stray torchrun variables from the caller."""
    for name in NODE_VARS:
        monkeypatch.delenv(name, raising=False)
    yield
    assert not dist.is_initialized(), "a test left a process group behind"


# ---------------------------------------------------------------- equivalence


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """2 single-process trainers, two runs in one spawn: all-reduce in float32, then in bfloat16."""
    return spawn_training(
        tmp_path_factory.mktemp("two"),
        2,
        1,
        {"sgd": ("sgd", False, {}), "bf16_wire": ("sgd", False, dict(grad_wire_dtype="bfloat16"))},
    )


@pytest.mark.timeout(60)
def test_two_trainer_processes_equal_single_process_training(two_processes):
    expected = reference(2, "sgd")
    for state in two_processes["sgd"]:
        assert_close(state, expected)


@pytest.mark.timeout(60)
def test_grad_wire_dtype_all_reduces_in_bfloat16_exactly_as_torchs_compress_hook(two_processes):
    expected, exact = bf16_reference(), reference(2, "sgd")
    got = two_processes["bf16_wire"]
    assert all(torch.equal(got[0][k], got[1][k]) for k in expected)
    off_exact = sum(int((got[0][k] != exact[k]).sum()) for k in expected)
    total = sum(v.numel() for v in expected.values())
    # Bit for bit (gloo's bfloat16 sum rounds as torch's); float32 all-reduce ends elsewhere.
    assert_close(got[0], expected, atol=0)
    assert off_exact > total // 2, (off_exact, total)


@pytest.mark.timeout(90)  # the first of these starts the module's four processes
def test_two_nodes_of_two_processes_from_torchrun_variables_equal_single_process_training(four_processes):
    expected = reference(4)
    for state in four_processes["plain"]:
        assert_close(state, expected)


@pytest.mark.timeout(90)
def test_local_sgd_every_step_equals_plain_collective_training(four_processes):
    # Gradients all-reduced within each node, parameters averaged over all 4 processes every step:
    # linear in the gradients for momentum SGD, so the same as all-reducing every gradient.
    for state, plain in zip(four_processes["local_sgd_1"], four_processes["plain"]):
        assert_close(state, plain)


@pytest.mark.timeout(90)
def test_local_sgd_with_a_longer_period_keeps_the_processes_apart_between_averages(four_processes):
    # 1 warm-up step of global all-reduce, then node-local gradients with parameters averaged over
    # all processes at steps 1, 4, ... (0-based): after steps 2 and 3 the two nodes have drifted
    # apart (their momentum buffers differ), while the processes of one node still agree.
    states = four_processes["local_sgd_3"]
    assert_close(states[1], states[0], atol=0)
    assert_close(states[3], states[2], atol=0)
    assert max((states[0][k] - states[2][k]).abs().max().item() for k in states[0]) > 1e-4


def test_trainer_makes_the_kind_the_plan_asks_for_and_both_kinds_are_trainers():
    from harness.cluster import LocalCluster

    with Trainer(collective_program()) as tr:
        assert type(tr) is CollectiveTrainer and isinstance(tr, Trainer)
        assert tr.sampler(list(range(8))).num_replicas == 1
    with pytest.raises(RuntimeError, match="collective trainer 0 .rank 0. is closed"):
        tr.step()
    with LocalCluster(program, 1, 1) as cluster:
        with cluster.trainer(0) as tr:
            assert type(tr) is PserverTrainer and isinstance(tr, Trainer)
            assert not isinstance(tr, CollectiveTrainer)
    with pytest.raises(RuntimeError, match="trainer 0 is closed"):
        tr.pull()


def test_one_process_equals_single_process_training():
    with CollectiveTrainer(collective_program()) as tr:
        for (batch,) in batches(1, PER_PROCESS * 2, STEPS):
            nn.functional.cross_entropy(tr.model(batch[0]), batch[1]).backward()
            assert tr.step() == tr.step_count
        assert tr.step_count == STEPS
        assert_close(tr.state_dict(), reference(2), atol=1e-6)


# ---------------------------------------------------------------- mixed precision


@pytest.mark.timeout(90)
def test_bf16_autocast_trains_the_mlp_example_to_its_accuracy_on_two_processes(tmp_path):
    epochs = 8  # about 0.97 test accuracy (12 epochs: 0.972)
    mp.spawn(amp_worker, args=(2, free_ports(1)[0], str(tmp_path), epochs), nprocs=2, join=True)
    results = [torch.load(tmp_path / f"rank{i}.pt", weights_only=True) for i in range(2)]
    for r in results:
        assert r["acc"] >= TARGET_ACCURACY, r["acc"]
        assert r["steps"] == epochs * 23  # 1437 examples / 2 processes / batch 32, rounded up
    assert_close(results[1]["state"], results[0]["state"], atol=0)  # DDP kept the replicas identical


def test_grad_scaler_step_unscales_and_skips_overflowed_steps():
    with CollectiveTrainer(collective_program()) as tr:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        for (batch,) in batches(1, PER_PROCESS * 2, STEPS):
            scaler.scale(nn.functional.cross_entropy(tr.model(batch[0]), batch[1])).backward()
            tr.step(scaler=scaler)
        # A power-of-two scale unscales exactly: the same parameters as unscaled training.
        assert_close(tr.state_dict(), reference(2), atol=1e-6)
        before = tr.state_dict()
        tr.model(torch.randn(2, 37)).sum().backward()
        tr.module.head.bias.grad[0] = float("inf")
        scale = scaler.get_scale()
        tr.step(scaler=scaler)
        assert_close(tr.state_dict(), before, atol=0)  # the overflowed step was skipped
        assert scaler.get_scale() == scale / 2


# ---------------------------------------------------------------- the Trainer surface


def test_trainer_surface_batches_position_sampler_state_dict_and_close():
    data = TensorDataset(torch.randn(10, 37), torch.randint(0, 5, (10,)))
    tr = CollectiveTrainer(collective_program())
    assert (tr.rank, tr.world_size, tr.local_rank, tr.device) == (0, 1, 0, torch.device("cpu"))
    sampler = tr.sampler(data, shuffle=True, seed=3)
    assert (sampler.num_replicas, sampler.rank) == (1, 0)
    loader = DataLoader(data, batch_size=4, sampler=sampler)
    positions = []
    for x, y in tr.batches(loader, epochs=2):
        nn.functional.cross_entropy(tr.model(x), y).backward()
        tr.step()
        positions.append(tr.position)
    assert positions == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3)] and tr.position == (2, 0)
    assert sampler.epoch == 1
    state = tr.state_dict(with_tables=True)
    assert set(state) == set(odd_mlp().state_dict())  # no DDP "module." prefix
    tr.pull()
    for call in (
        lambda: tr.checkpoint(),
        lambda: tr.save_tables("x"),
        lambda: tr.prefetch({"emb": [1]}),
        lambda: tr.pull_rows("emb", [1]),
    ):
        with pytest.raises(AttributeError, match="collective mode .* has none"):
            call()
    assert isinstance(tr.model, nn.parallel.DistributedDataParallel)
    tr.close()
    tr.close()
    assert not dist.is_initialized() and tr.model is tr.module
    with pytest.raises(RuntimeError, match="is closed"):
        tr.step()


def test_a_process_group_made_by_the_script_is_used_and_left_alone():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with CollectiveTrainer(collective_program()) as tr:
            nn.functional.cross_entropy(tr.model(torch.randn(3, 37)), torch.tensor([0, 1, 2])).backward()
            tr.step()
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- refused


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(mode="ring"), "mode must be one of"),
        (dict(bucket_cap_mb=0), "bucket_cap_mb must be a positive number"),
        (dict(bucket_cap_mb=True), "bucket_cap_mb must be a positive number"),
        (dict(mode="collective", local_sgd_steps=0), "local_sgd_steps must be an int >= 1"),
        (dict(mode="collective", local_sgd_steps=2.5), "local_sgd_steps must be an int >= 1"),
        (dict(mode="collective", local_sgd_warmup_steps=-1), "local_sgd_warmup_steps must be an int >= 0"),
        (dict(mode="collective", use_local_sgd=1), "use_local_sgd must be a bool"),
        (dict(use_local_sgd=True), "use_local_sgd needs mode='collective'"),
    ],
)
def test_bad_collective_config_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DistributeTranspilerConfig(**kwargs)


def test_nccl2_is_an_alias_of_collective_and_round_trips():
    config = DistributeTranspilerConfig(mode="nccl2", bucket_cap_mb=4, use_local_sgd=True, local_sgd_steps=8)
    assert config.mode == "collective" and config.collective
    assert not DistributeTranspilerConfig().collective
    tp = collective_program(1, 3, use_local_sgd=True, local_sgd_steps=8)
    assert tp.collective and tp.pservers == [] and tp.blocks == [] and tp.trainers == 3
    assert [p.name for p in tp.params] == [n for n, _ in odd_mlp().named_parameters()]
    assert tp.optimizer.lr_scheduler == "StepLR"
    again = TrainerProgram.from_bytes(tp.to_bytes(), model=tp.model)
    assert again == tp and again.collective
    assert "collective (DDP, no pservers)" in str(tp) and "Local SGD every 8 steps" in str(tp)


def test_collective_transpile_refuses_tables_async_and_pserver_programs():
    model = nn.Sequential()
    model.add_module("emb", nn.Embedding(100, 8))
    model.add_module("fc", nn.Linear(8, 2))
    t = DistributeTranspiler(DistributeTranspilerConfig(mode="collective"))
    with pytest.raises(ValueError, match="distributed tables \\['emb'\\] need pservers.*use mode='pserver'"):
        t.transpile(0, program=Program(model, distributed_tables=["emb"]), pservers="", trainers=1)
    with pytest.raises(ValueError, match="collective mode is synchronous"):
        t.transpile(0, program=program(), pservers=None, trainers=2, sync_mode=False)
    # Pservers a shared script passes anyway are ignored; none gets a program.
    t.transpile(0, program=program(), pservers="127.0.0.1:6170", trainers=2)
    assert t.get_trainer_program().pservers == []
    with pytest.raises(ValueError, match="no pserver program .* collective mode"):
        t.get_pserver_program("127.0.0.1:6170")
    with pytest.raises(ValueError, match="no pserver program .* collective mode"):
        t.get_startup_program("127.0.0.1:6170")


def test_collective_trainer_refuses_a_pserver_plan_and_a_mismatched_world(monkeypatch):
    t = DistributeTranspiler()
    t.transpile(0, program=program(), pservers="127.0.0.1:6170", trainers=1)
    with pytest.raises(ValueError, match="CollectiveTrainer trains mode='collective' programs"):
        CollectiveTrainer(t.get_trainer_program())
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(
        ValueError, match=r"WORLD_SIZE=2, but collective mode runs trainers \(2.*= 4 processes"
    ):
        CollectiveTrainer(collective_program(0, 2))
    with pytest.raises(ValueError, match="local_rank 2 is out of range"):
        CollectiveTrainer(collective_program(0, 2), local_rank=2, local_world_size=2)
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ValueError, match="need a rendezvous: set MASTER_ADDR and MASTER_PORT"):
        CollectiveTrainer(collective_program(0, 2), local_rank=0)


# ---------------------------------------------------------------- CUDA (run only where there is a GPU)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (NCCL backend, cuda:LOCAL_RANK)")


@cuda
def test_cuda_model_on_local_rank_device_with_nccl_in_a_one_process_group():
    with CollectiveTrainer(collective_program()) as tr:
        assert tr.device == torch.device("cuda", 0) and dist.get_backend() == "nccl"
        assert all(p.device == tr.device for p in tr.module.parameters())
        for (batch,) in batches(1, PER_PROCESS * 2, STEPS):
            nn.functional.cross_entropy(tr.model(batch[0].to(tr.device)), batch[1].to(tr.device)).backward()
            tr.step()
        # GPU kernels round differently from CPU ones; the steps still match closely.
        assert_close(tr.state_dict(), reference(2), atol=1e-4)
