"""LocalBlocks: a block's view is its parameter's rows, kept across pulls, and cut again once the
parameter's data is replaced."""

from __future__ import annotations

import torch

from harness.models import odd_mlp
from trainer.blocks import LocalBlocks
from transpiler import DistributeTranspiler, DistributeTranspilerConfig, Program
from transpiler.placement import as_rows


def blocks_of(model) -> LocalBlocks:
    t = DistributeTranspiler(DistributeTranspilerConfig())
    t.transpile(0, program=Program(model, "sgd", lr=0.1), pservers="127.0.0.1:1,127.0.0.1:2", trainers=1)
    return LocalBlocks(t.get_trainer_program(), model)


def test_a_view_is_the_parameter_s_rows_and_is_kept():
    model = odd_mlp(dtype=torch.float32)
    blocks = blocks_of(model)
    params = dict(model.named_parameters())
    for b in blocks.by_name.values():
        view = blocks.view(b)
        assert blocks.view(b) is view  # kept
        view.fill_(float(b.row_start) + 0.5)  # lands in the parameter itself
        rows = as_rows(params[b.param].data)[b.row_start : b.row_end]
        assert bool((rows == float(b.row_start) + 0.5).all())
    assert len(blocks._views) == len(blocks.by_name)  # one per block, however many pulls


def test_a_replaced_parameter_gets_a_new_view():
    model = odd_mlp(dtype=torch.float32)
    blocks = blocks_of(model)
    b = next(iter(blocks.by_name.values()))
    param = dict(model.named_parameters())[b.param]
    old = blocks.view(b)
    param.data = torch.zeros_like(param.data)  # as module.to() or a user's reassignment does
    new = blocks.view(b)
    assert new is not old and new.data_ptr() != old.data_ptr()
    new.fill_(2.0)
    assert bool((as_rows(param.data)[b.row_start : b.row_end] == 2.0).all())
    assert not bool((old == 2.0).any())  # the old storage is not the parameter any more
