"""Mixed precision with pservers: bf16 autocast on the trainers, fp32 master parameters on the pservers.

The MLP example's model, 2 pservers x 2 trainers in sync mode, forward passes
under ``torch.autocast(dtype=torch.bfloat16)``: it reaches the example's
accuracy target, the pservers' parameters stay fp32, and both trainers end
with the same model. (Collective mode's bf16 test is in test_collective.py.)
"""

import os
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from harness.cluster import LocalCluster
from tests.helpers import paths

REPO = str(paths.REPO)
sys.path.insert(0, os.path.join(REPO, "examples"))
from train_mlp import TARGET_ACCURACY, accuracy, build_program, load_digits_split  # noqa: E402

EPOCHS = 8


@pytest.mark.timeout(120)
def test_bf16_autocast_with_pservers_trains_the_example_to_its_accuracy():
    train, test = load_digits_split()

    def body(tr, i):
        loader = DataLoader(train, batch_size=32, sampler=tr.sampler(train, shuffle=True, seed=0))
        for x, y in tr.batches(loader, EPOCHS):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = tr.model(x)
                assert logits.dtype == torch.bfloat16  # the forward really ran in bf16
                loss = nn.functional.cross_entropy(logits, y)
            loss.backward()
            tr.step()
        return tr.state_dict(), accuracy(tr.model, test)

    with LocalCluster(build_program, 2, 2) as cluster:
        results = cluster.run_trainers(body, timeout=100)
        stores = [s.engine.store for s in cluster.servers]
        master = [t for store in stores for _, t in store.read(list(store.names()), copy=True)]
    assert master and all(t.dtype == torch.float32 for t in master)
    (state0, acc0), (state1, acc1) = results[0], results[1]
    assert acc0 >= TARGET_ACCURACY and acc1 >= TARGET_ACCURACY, (acc0, acc1)
    for k in state0:
        assert state0[k].dtype == torch.float32
        torch.testing.assert_close(state0[k], state1[k], rtol=0, atol=0)
