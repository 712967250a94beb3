"""Slicing, placement, plans and config checks of the transpiler."""

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from harness.models import odd_mlp
from tests.helpers import paths
from transpiler import (
    DistributeTranspiler,
    DistributeTranspilerConfig,
    Program,
    PserverProgram,
    RoleEnv,
    StartupProgram,
    TrainerProgram,
)
from transpiler.optim import LrSchedule
from transpiler.placement import block_count, split_rows, stable_hash_name

EPS2 = "127.0.0.1:6170,127.0.0.1:6171"
EPS3 = EPS2 + ",127.0.0.1:6172"
REPO = str(paths.REPO)


def run_together(cmds, envs=None, expect_rc=None, timeout=60):
    """Run ``cmds`` side by side from REPO (each mostly imports torch: the second core does the
    other half); the stdouts, or (returncode, stdout, stderr) each if ``expect_rc`` is None."""
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
        for cmd, env in zip(cmds, envs or [None] * len(cmds))
    ]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
        results = [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    if expect_rc is None:
        return results
    for rc, out, err in results:
        assert rc == expect_rc, err
    return [out for _, out, _ in results]


def transpile(model=None, pservers=EPS2, trainers=2, **config):
    t = DistributeTranspiler(DistributeTranspilerConfig(**config))
    t.transpile(0, program=Program(model or odd_mlp(), "sgd", lr=0.1), pservers=pservers, trainers=trainers)
    return t


def test_block_count_follows_the_formula():
    # min(#pservers, max(1, numel // min_block_size)), never more blocks than rows
    assert block_count(16761, 453, 2, 8192, True) == 2
    assert block_count(27633, 61, 3, 8192, True) == 3
    assert block_count(27633, 61, 8, 8192, True) == 3
    assert block_count(8191, 8191, 4, 8192, True) == 1
    assert block_count(10 * 8192, 2, 4, 8192, True) == 2  # only 2 rows to cut
    assert block_count(10**6, 1000, 4, 8192, False) == 1


def test_split_rows_as_equal_as_rows_allow():
    assert split_rows(61, 3) == [(0, 21), (21, 41), (41, 61)]
    assert split_rows(453, 2) == [(0, 227), (227, 453)]
    assert split_rows(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError):
        split_rows(2, 3)


def test_blocks_cover_every_row_exactly_once():
    tp = transpile(pservers=EPS3).get_trainer_program()
    model = odd_mlp()
    for spec in tp.params:
        p = dict(model.named_parameters())[spec.name]
        rows = p.shape[0] if p.dim() else 1
        covered = [r for b in spec.blocks for r in range(b.row_start, b.row_end)]
        assert covered == list(range(rows)), spec.name
        assert sum(b.numel for b in spec.blocks) == p.numel()
        assert [b.name for b in spec.blocks] == [f"{spec.name}.block{i}" for i in range(len(spec.blocks))]
    fc2 = {p.name: p for p in tp.params}["fc2.weight"]
    assert [b.shape for b in fc2.blocks] == [[21, 453], [20, 453], [20, 453]]


def test_round_robin_deals_blocks_in_order():
    tp = transpile(pservers=EPS3).get_trainer_program()
    eps = EPS3.split(",")
    assert [b.endpoint for b in tp.blocks] == [eps[i % 3] for i in range(len(tp.blocks))]


def test_hash_name_is_stable_across_processes_and_independent_of_order():
    tp = transpile(pservers=EPS3, split_method="HashName").get_trainer_program()
    eps = EPS3.split(",")
    for b in tp.blocks:
        expected = int.from_bytes(hashlib.blake2b(b.name.encode(), digest_size=8).digest(), "little")
        assert b.endpoint == eps[expected % 3]
    # Python's own str hash is salted per process; ours must not be.
    code = "from transpiler.placement import stable_hash_name; print(stable_hash_name('fc2.weight.block1'))"
    outs = {
        out.strip()
        for out in run_together(
            [[sys.executable, "-c", code]] * 3,
            [{**os.environ, "PYTHONHASHSEED": seed} for seed in ("1", "2", "3")],
            expect_rc=0,
        )
    }
    assert outs == {str(stable_hash_name("fc2.weight.block1"))}
    # Known answer, pinned so a change of hash function cannot go unnoticed.
    assert stable_hash_name("fc2.weight.block1") == int.from_bytes(
        hashlib.blake2b(b"fc2.weight.block1", digest_size=8).digest(), "little"
    )


def test_slice_var_up_false_keeps_one_block_per_parameter():
    tp = transpile(pservers=EPS3, slice_var_up=False).get_trainer_program()
    assert all(len(p.blocks) == 1 and p.blocks[0].shape == p.shape for p in tp.params)


def test_min_block_size_below_8192_is_refused_with_reason():
    with pytest.raises(ValueError, match=r"min_block_size=4096 is refused.*at least 8192"):
        DistributeTranspilerConfig(min_block_size=4096)
    cfg = DistributeTranspilerConfig()
    cfg.min_block_size = 100  # set after construction: caught at transpile
    with pytest.raises(ValueError, match="min_block_size=100 is refused"):
        DistributeTranspiler(cfg).transpile(0, program=Program(odd_mlp()), pservers=EPS2, trainers=1)


def test_bigger_min_block_size_means_fewer_blocks():
    small = transpile(pservers=EPS3, min_block_size=8192).get_trainer_program()
    big = transpile(pservers=EPS3, min_block_size=20000).get_trainer_program()
    assert len({p.name: p for p in small.params}["fc1.weight"].blocks) == 2
    assert len({p.name: p for p in big.params}["fc1.weight"].blocks) == 1


def test_plans_round_trip_through_bytes():
    t = transpile(pservers=EPS3, split_method="HashName")
    tp = t.get_trainer_program()
    tp2 = TrainerProgram.from_bytes(tp.to_bytes(), model=tp.model)
    assert tp2 == tp and tp2.to_bytes() == tp.to_bytes()
    json.loads(tp.to_bytes())  # plain JSON, readable by any tool
    for ep in EPS3.split(","):
        pp = t.get_pserver_program(ep)
        assert PserverProgram.from_bytes(pp.to_bytes()) == pp
        sp = t.get_startup_program(ep, pp)
        sp2 = StartupProgram.from_bytes(sp.to_bytes())
        assert sp2.endpoint == ep and sp2.tensors.keys() == {b.name for b in pp.blocks}
        for name, value in sp.tensors.items():
            assert torch.equal(sp2.tensors[name], value)


def test_plans_print_blocks_and_pservers():
    t = transpile(pservers=EPS3)
    text = str(t.get_trainer_program())
    assert "fc2.weight.block2" in text and "41:61" in text and "127.0.0.1:6172" in text
    assert "20x453" in text and f"{20 * 453 * 4:,}" in text
    assert "PserverProgram 127.0.0.1:6171" in str(t.get_pserver_program("127.0.0.1:6171"))


def test_startup_values_are_the_model_rows():
    model = odd_mlp()
    t = transpile(model=model, pservers=EPS3)
    values = {}
    for ep in EPS3.split(","):
        values.update(t.get_startup_program(ep).tensors)
    w = model.fc2.weight.detach()
    assert torch.equal(torch.cat([values[f"fc2.weight.block{i}"] for i in range(3)]), w)
    assert torch.equal(values["scale.block0"], model.scale.detach())


def test_malformed_plan_bytes_are_refused():
    for data in (b"", b"\xff\xfe garbage", b'{"kind": "TrainerProgram"}', b"[]"):
        with pytest.raises(ValueError):
            TrainerProgram.from_bytes(data)
        with pytest.raises(ValueError):
            PserverProgram.from_bytes(data)
    with pytest.raises(ValueError):
        StartupProgram.from_bytes(b"not a torch file")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(trainer_id=2, trainers=2), "trainer_id 2 is out of range"),
        (dict(trainer_id=0, trainers=0), "trainers must be an int >= 1"),
        (dict(trainer_id=0, trainers=1, pservers="127.0.0.1"), "not of the form host:port"),
        (dict(trainer_id=0, trainers=1, pservers="a:1,a:1"), "listed twice"),
        (dict(trainer_id=0, trainers=1, pservers=""), "empty"),
    ],
)
def test_transpile_refuses_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DistributeTranspiler().transpile(program=Program(odd_mlp()), **{"pservers": EPS2, **kwargs})


def test_unknown_endpoint_is_refused():
    with pytest.raises(ValueError, match="not one of the pservers"):
        transpile().get_pserver_program("127.0.0.1:9999")


def test_program_checks_optimizer_and_kwargs():
    with pytest.raises(ValueError, match="unknown optimizer 'lamb'"):
        Program(odd_mlp(), "lamb")
    with pytest.raises(ValueError, match=r"does not take \['momentun'\]"):
        Program(odd_mlp(), "sgd", lr=0.1, momentun=0.9)
    with pytest.raises(ValueError):
        Program(odd_mlp(), "adam", lr=-1.0)  # torch's own check, run in the user's process
    with pytest.raises(ValueError, match="unknown lr_scheduler"):
        Program(odd_mlp(), "sgd", lr_scheduler="Warmup")
    assert Program(odd_mlp(), "momentum", lr=0.1).optimizer.kwargs["momentum"] == 0.9


@pytest.mark.parametrize(
    "name,kwargs",
    [
        ("StepLR", {"step_size": 3, "gamma": 0.5}),
        ("CosineAnnealingLR", {"T_max": 7}),
        ("LinearLR", {"start_factor": 0.25, "total_iters": 4}),
    ],
)
def test_lr_schedule_matches_torch_scheduler(name, kwargs):
    spec = Program(odd_mlp(), "sgd", lr=0.2, lr_scheduler=name, lr_scheduler_kwargs=kwargs).optimizer
    schedule = LrSchedule(spec)
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.2)
    sched = getattr(torch.optim.lr_scheduler, name)(opt, **kwargs)
    for step in range(12):
        assert schedule.lr_at(step) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12)
        opt.step()
        sched.step()


def test_role_env_reads_paddle_variables():
    base = {"PADDLE_PSERVERS_IP_PORT_LIST": EPS2, "PADDLE_TRAINERS_NUM": "2"}
    assert RoleEnv.from_env({}) is None
    tr = RoleEnv.from_env({**base, "TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": "1"})
    assert (tr.role, tr.trainer_id, tr.trainers, tr.pservers) == ("TRAINER", 1, 2, EPS2.split(","))
    ps = RoleEnv.from_env({**base, "TRAINING_ROLE": "PSERVER", "POD_IP": "127.0.0.1", "PADDLE_PORT": "6171"})
    assert ps.is_pserver and ps.current_endpoint == "127.0.0.1:6171"
    with pytest.raises(ValueError, match="PADDLE_TRAINER_ID is not set"):
        RoleEnv.from_env({**base, "TRAINING_ROLE": "TRAINER"})
    with pytest.raises(ValueError, match="out of range"):
        RoleEnv.from_env({**base, "TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": "2"})
    with pytest.raises(ValueError, match="is not in PADDLE_PSERVERS_IP_PORT_LIST"):
        RoleEnv.from_env({**base, "TRAINING_ROLE": "PSERVER", "POD_IP": "127.0.0.1", "PADDLE_PORT": "7000"})
    with pytest.raises(ValueError, match="TRAINING_ROLE must be one of"):
        RoleEnv.from_env({**base, "TRAINING_ROLE": "WORKER"})


def test_show_command_prints_the_layout():
    show = [sys.executable, "-m", "transpiler", "show", "examples/train_mlp.py:build_program"]
    (rc, out, err), (bad_rc, _, bad_err) = run_together(
        [
            show + ["--pservers", EPS3, "--split_method", "HashName", "--min_block_size", "16384"],
            show + ["--min_block_size", "1000"],
        ]
    )
    assert rc == 0, err
    assert "2.weight.block0" in out and "per pserver:" in out
    assert bad_rc == 2 and "min_block_size=1000 is refused" in bad_err


def test_model_without_parameters_is_refused():
    with pytest.raises(ValueError, match="no trainable parameters"):
        Program(nn.ReLU())
