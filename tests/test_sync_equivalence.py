"""Sync mode equals single-process training on the concatenated batch.

N trainers on batch b with a mean loss, k sync steps, must give the same
parameters as one process on the N*b batch, for every optimizer, both
dispatchers, slicing on and off, 2 and 3 pservers.

The matrix runs in float64: adaptive optimizers divide a gradient by its own
magnitude, so where a gradient is a near-cancelling sum, float32 rounding of
"mean of two half-batch gradients" versus "gradient of the whole batch" is
amplified up to lr * 1e-3 (seen with Adagrad). In float64 the same logic is
checked to 1e-12, rounding's own size there; float32 runs check sgd and
momentum, whose updates are linear in the gradient: 4 steps of them used 0.016
of the float32 bound with ATen's and MKL's AVX2 kernels, 0.024 with their
non-vectorized ones, a margin no CPU's kernels take.
"""

import itertools

import pytest
import torch
from torch import nn

from harness.cluster import LocalCluster
from harness.models import FLOAT64_EXACT, batches, odd_mlp, train_concatenated, train_distributed
from transpiler import DistributeTranspilerConfig, Program

STEPS = 4
PER_TRAINER = 8
N_TRAINERS = 2

OPTIMIZERS = {
    "sgd": dict(lr=0.1),
    "momentum": dict(
        lr=0.05,
        momentum=0.9,
        weight_decay=0.01,
        lr_scheduler="StepLR",
        lr_scheduler_kwargs={"step_size": 2, "gamma": 0.5},
    ),
    "adam": dict(lr=0.01, weight_decay=0.01),
    "adagrad": dict(lr=0.1, weight_decay=0.01),
}


def program(optimizer: str, dtype: torch.dtype = torch.float64) -> Program:
    return Program(odd_mlp(dtype=dtype), optimizer, **OPTIMIZERS[optimizer])


def single_process(optimizer: str, data, dtype: torch.dtype = torch.float64) -> dict:
    """The reference: plain torch on the concatenation of all trainers' batches."""
    return train_concatenated(program(optimizer, dtype), data)


def assert_params_close(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        tolerance = FLOAT64_EXACT if expected[name].dtype == torch.float64 else dict(rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(actual[name], expected[name], **tolerance, msg=lambda m: f"{name}: {m}")


CASES = [
    (*case, torch.float64)
    for case in itertools.product([2, 3], ["RoundRobin", "HashName"], [True, False], sorted(OPTIMIZERS))
]
CASES += [(n, "RoundRobin", True, opt, torch.float32) for n in (2, 3) for opt in ("sgd", "momentum")]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n_pservers,split_method,slice_var_up,optimizer,dtype", CASES)
def test_sync_matches_single_process(n_pservers, split_method, slice_var_up, optimizer, dtype):
    data = batches(N_TRAINERS, PER_TRAINER, STEPS, dtype=dtype)
    config = DistributeTranspilerConfig(slice_var_up=slice_var_up, split_method=split_method)
    with LocalCluster(lambda: program(optimizer, dtype), n_pservers, N_TRAINERS, config=config) as cluster:
        layout = cluster.transpiler().get_trainer_program()
        if slice_var_up:  # the case really slices: some parameter spans several pservers
            assert max(len(p.blocks) for p in layout.params) == n_pservers
        else:
            assert all(len(p.blocks) == 1 for p in layout.params)
        states = train_distributed(cluster, data)
    expected = single_process(optimizer, data, dtype)
    for i in range(N_TRAINERS):
        assert_params_close(states[i], expected)
    # The update really moved the parameters (a no-op would also "match" a no-op).
    initial = odd_mlp(dtype=dtype).state_dict()
    assert not torch.allclose(states[0]["fc2.weight"], initial["fc2.weight"])


@pytest.mark.timeout(60)
def test_trainer_that_stops_early_does_not_stall_the_other():
    """Trainer 1 has 2 batches, trainer 0 has 5: after trainer 1 closes, steps use trainer 0 alone."""
    data = batches(N_TRAINERS, PER_TRAINER, 5, dtype=torch.float64)
    short = 2

    def body(tr, i):
        for s, step_batches in enumerate(data):
            if i == 1 and s == short:
                break
            x, y = step_batches[i]
            nn.functional.cross_entropy(tr.model(x), y).backward()
            tr.step()
        # Trainer 1's pull waits for its own last step only: its model is the one after step 2.
        return tr.step_count, tr.state_dict()

    with LocalCluster(lambda: program("adam"), 2, N_TRAINERS) as cluster:
        results = cluster.run_trainers(body, timeout=30)
        assert results[0][0] == len(data) and results[1][0] == short
        assert all(s.engine.step == len(data) for s in cluster.servers)

    # Reference: the mean over both batches while both trainers run, then trainer 0's batch alone.
    reference_data = [sb if s < short else [sb[0]] for s, sb in enumerate(data)]
    assert_params_close(results[0][1], single_process("adam", reference_data))
    assert_params_close(results[1][1], single_process("adam", data[:short]))
