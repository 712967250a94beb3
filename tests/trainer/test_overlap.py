"""Pushes that stream during backward (``push_during_backward=True``; off by default).

Each pserver's PushPull opens when backward produces the first gradient and
carries each block as its gradient becomes final; the result must be exactly
that of pushing after backward (single-process training on the concatenated
batches), and a second backward pass in one step must fail loudly rather
than push a partial gradient.
"""

import pytest
import torch
from torch import nn

from harness.cluster import LocalCluster
from harness.models import assert_state_close, batches, odd_mlp, train_concatenated
from transpiler import DistributeTranspilerConfig, Program

STEPS = 3


def program() -> Program:
    return Program(odd_mlp(dtype=torch.float64), "adam", lr=0.01)


@pytest.mark.timeout(60)
def test_pushes_open_during_backward_and_train_as_one_process():
    data = batches(2, 8, STEPS, dtype=torch.float64)
    with LocalCluster(program, 2, 2, config=DistributeTranspilerConfig(push_during_backward=True)) as cluster:

        def body(tr, i):
            opened = []
            for step_batches in data:
                x, y = step_batches[i]
                assert not tr.stepper.overlap.started
                nn.functional.cross_entropy(tr.model(x), y).backward()
                opened.append(tr.stepper.overlap.started)  # every pserver's stream is open before step()
                tr.step()
            return opened, tr.state_dict()

        results = cluster.run_trainers(body)
    expected = train_concatenated(program(), data)
    for opened, state in results.values():
        assert opened == [True] * STEPS
        assert_state_close(state, expected, atol=1e-10)


@pytest.mark.timeout(60)
def test_a_second_backward_in_one_step_raises_and_the_switch_allows_accumulation():
    data = batches(1, 8, 2, dtype=torch.float64)
    halves = [[(x[:4], y[:4]), (x[4:], y[4:])] for ((x, y),) in data]
    with LocalCluster(program, 1, 1, config=DistributeTranspilerConfig(push_during_backward=True)) as cluster:

        def body(tr, i):
            x, y = data[0][0]
            nn.functional.cross_entropy(tr.model(x[:4]), y[:4]).backward()
            with pytest.raises(RuntimeError, match="push_during_backward=False"):
                nn.functional.cross_entropy(tr.model(x[4:]), y[4:]).backward()
            return tr.step_count

        assert cluster.run_trainers(body) == {0: 0}
        assert cluster.servers[0].engine.step == 0  # the abandoned streams counted nothing

    with LocalCluster(program, 1, 1) as cluster:  # the default: push after backward

        def accumulate(tr, i):
            assert tr.stepper.overlap is None
            for parts in halves:
                for x, y in parts:  # two half-batch losses, each halved: the full batch's mean loss
                    (nn.functional.cross_entropy(tr.model(x), y) / 2).backward()
                tr.step()
            return tr.state_dict()

        state = cluster.run_trainers(accumulate)[0]
    assert_state_close(state, train_concatenated(program(), data), atol=1e-10)
