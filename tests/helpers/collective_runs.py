"""Collective-mode training for tests/trainer/test_collective.py: the program every test trains, its
single-process references, and the workers spawned processes run (importable by name, as spawn needs).
"""

from __future__ import annotations

import gc
import os
import sys

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader

from harness.models import batches, odd_mlp
from harness.ports import free_ports
from tests.helpers import paths
from trainer.collective import CollectiveTrainer
from transpiler import DistributeTranspiler, DistributeTranspilerConfig, Program, TrainerProgram
from transpiler.optim import LR_SCHEDULERS

sys.path.insert(0, os.path.join(str(paths.REPO), "examples"))
from train_mlp import accuracy, build_program, load_digits_split  # noqa: E402

NODE_VARS = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
STEPS, PER_PROCESS = 4, 6
SCHEDULE = {"step_size": 2, "gamma": 0.5}


def program(optimizer="momentum"):
    """The program every test trains: OddMLP, sgd/momentum with weight decay, lr halving every 2 steps."""
    return Program(
        odd_mlp(), optimizer, lr=0.1, weight_decay=0.01, lr_scheduler="StepLR", lr_scheduler_kwargs=SCHEDULE
    )


def collective_program(trainer_id=0, trainers=1, prog=None, **config) -> TrainerProgram:
    t = DistributeTranspiler(DistributeTranspilerConfig(mode="collective", barrier_timeout=60, **config))
    t.transpile(trainer_id, program=prog or program(), pservers=None, trainers=trainers)
    return t.get_trainer_program()


def reference(nprocs, optimizer="momentum"):
    """Single-process training on the concatenated batches of ``nprocs`` processes: the expected
    parameters."""
    prog = program(optimizer)
    opt = prog.optimizer.build(prog.model.parameters())
    sched = LR_SCHEDULERS["StepLR"](opt, **SCHEDULE)
    for step_batches in batches(nprocs, PER_PROCESS, STEPS):
        x, y = torch.cat([b[0] for b in step_batches]), torch.cat([b[1] for b in step_batches])
        opt.zero_grad()
        nn.functional.cross_entropy(prog.model(x), y).backward()
        opt.step()
        sched.step()
    return prog.model.state_dict()


def bf16_reference():
    """Two processes all-reducing in bfloat16 (torch's bf16_compress_hook), done in one: each rank's
    gradient cast to bfloat16 and halved, the two summed in bfloat16, the sum widened.

    On one torch thread, as the workers (train_worker): the float32 gradients then have the workers'
    bits. With two threads a few differ in the last bit, and the few of those that sit on a bfloat16
    rounding boundary round the other way (4 of 45k elements, 1.5e-6 off; 3e-6 with another CPU's
    kernels), each as far off as one bfloat16 rounding of its gradient times lr."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        prog = program("sgd")
        opt = prog.optimizer.build(prog.model.parameters())
        sched = LR_SCHEDULERS["StepLR"](opt, **SCHEDULE)
        params = list(prog.model.parameters())
        for step_batches in batches(2, PER_PROCESS, STEPS):
            halves = []
            for x, y in step_batches:
                prog.model.zero_grad()
                nn.functional.cross_entropy(prog.model(x), y).backward()
                halves.append([p.grad.to(torch.bfloat16).div_(2) for p in params])
            for p, (a, b) in zip(params, zip(*halves)):
                p.grad = (a + b).float()
            opt.step()
            sched.step()
        return prog.model.state_dict()
    finally:
        torch.set_num_threads(threads)


def assert_close(got, expected, atol=1e-5):
    """1e-5 against :func:`reference`: 4 float32 steps of sgd/momentum (linear in the gradient) used 0.006
    of it with ATen's and MKL's AVX2 kernels and with their non-vectorized ones, a margin no CPU takes."""
    assert got.keys() == expected.keys()
    for k in expected:
        torch.testing.assert_close(got[k].cpu(), expected[k], atol=atol, rtol=0, msg=k)


def train_worker(index, trainers, lws, out, runs):
    """Process ``index`` of ``trainers`` x ``lws``: for each run, train STEPS steps on its part of each
    global batch with a fresh CollectiveTrainer (and process group), and save its parameters."""
    torch.set_num_threads(1)
    trainer_id, local_rank = divmod(index, lws)
    for name, port, optimizer, use_env, config in runs:
        kwargs = {}
        if use_env:  # as torchrun would set them
            os.environ.update(
                LOCAL_RANK=str(local_rank),
                LOCAL_WORLD_SIZE=str(lws),
                RANK=str(index),
                WORLD_SIZE=str(trainers * lws),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
        else:
            kwargs = dict(local_rank=local_rank, local_world_size=lws, init_method=f"tcp://127.0.0.1:{port}")
        tp = collective_program(trainer_id, trainers, program(optimizer), **config)
        with CollectiveTrainer(tp, **kwargs) as tr:
            assert (tr.rank, tr.world_size) == (index, trainers * lws)
            for step_batches in batches(trainers * lws, PER_PROCESS, STEPS):
                x, y = step_batches[tr.rank]
                nn.functional.cross_entropy(tr.model(x.to(tr.device)), y.to(tr.device)).backward()
                tr.step()
            torch.save(tr.state_dict(), os.path.join(out, f"{name}-rank{index}.pt"))
        for var in NODE_VARS:
            os.environ.pop(var, None)
    gc.freeze()  # done: a quicker exit (tests/helpers/nodes.py, PROCESS_TIMEOUT's note)


def amp_worker(index, nprocs, port, out, epochs):
    """Train the MLP example under bf16 autocast, one of ``nprocs`` single-process trainers; save accuracy."""
    torch.set_num_threads(1)
    train, test = load_digits_split()
    t = DistributeTranspiler(DistributeTranspilerConfig(mode="nccl2", barrier_timeout=60))
    t.transpile(index, program=build_program(), pservers="", trainers=nprocs)
    with CollectiveTrainer(
        t.get_trainer_program(), local_rank=0, local_world_size=1, init_method=f"tcp://127.0.0.1:{port}"
    ) as tr:
        loader = DataLoader(train, batch_size=32, sampler=tr.sampler(train, shuffle=True, seed=0))
        tr.model.train()
        for x, y in tr.batches(loader, epochs):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(tr.model(x), y)
            assert loss.dtype == torch.float32  # autocast computes the loss in fp32 from bf16 logits
            loss.backward()
            tr.step()
        assert tr.position == (epochs, 0)
        state = tr.state_dict()
    torch.save(
        {"acc": accuracy(tr.model, test), "state": state, "steps": tr.step_count},
        os.path.join(out, f"rank{index}.pt"),
    )
    gc.freeze()  # done: a quicker exit (tests/helpers/nodes.py, PROCESS_TIMEOUT's note)


def spawn_training(out, trainers, lws, runs):
    """Run ``trainers`` x ``lws`` collective processes through ``runs`` ({name: (optimizer, use_env,
    config)}); the saved states of each run, by rank."""
    n = trainers * lws
    ports = free_ports(len(runs))
    plan = [(name, port, *run) for (name, run), port in zip(runs.items(), ports)]
    with pytest.MonkeyPatch.context() as mpatch:  # the workers inherit this environment
        for name in NODE_VARS:
            mpatch.delenv(name, raising=False)
        mp.spawn(train_worker, args=(trainers, lws, str(out), plan), nprocs=n, join=True)
    return {
        name: [torch.load(out / f"{name}-rank{i}.pt", weights_only=True) for i in range(n)] for name in runs
    }
