"""The README's "API in one screen" runs as written: as a pserver and a trainer under ps-launch, and,
started alone, it stops saying what it needs.

The snippet is read from README.md itself, so it cannot drift from what runs. The test fills in only
what the snippet leaves to the reader, ``dataset`` (96 examples of 64 features whose class is the
largest of the first 10, the snippet's model's shapes), and seeds torch, so that the trained model can
be compared with the one the job started from.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

from tests.helpers.launch import run_ps_launch
from tests.helpers.paths import REPO

# Every test here starts pservers and trainers as separate processes.
pytestmark = pytest.mark.processes

SECTION = "## The API in one screen"
# What the snippet leaves to the reader, put before it: a dataset, and one seed for every role.
DATASET = """\
import torch

_features = torch.randn(96, 64, generator=torch.Generator().manual_seed(1))
dataset = torch.utils.data.TensorDataset(_features, _features[:, :10].argmax(1))
torch.manual_seed(0)
"""


def readme_snippet() -> str:
    """The Python block of the README's "API in one screen" section."""
    text = (REPO / "README.md").read_text()
    section = text[text.index(SECTION) :]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def snippet_model() -> nn.Module:
    """The model the snippet builds, built here from its own line after the same seed."""
    line = re.search(r"^model = .*$", readme_snippet(), re.MULTILINE).group(0)
    namespace = {"nn": nn}
    torch.manual_seed(0)
    exec(line, namespace)
    return namespace["model"]


def accuracy_and_loss(model: nn.Module, data: torch.utils.data.TensorDataset):
    x, y = data.tensors
    with torch.no_grad():
        logits = model(x)
    return (logits.argmax(1) == y).float().mean().item(), nn.functional.cross_entropy(logits, y).item()


def the_dataset() -> torch.utils.data.TensorDataset:
    namespace = {}
    exec(DATASET, namespace)
    return namespace["dataset"]


@pytest.mark.timeout(150)  # 30-50 s on 2 shared cores; the bound leaves room for a loaded machine
def test_the_readme_api_trains_as_a_pserver_and_a_trainer_under_ps_launch(tmp_path):
    (tmp_path / "train.py").write_text(DATASET + readme_snippet())
    result = run_ps_launch(["--server_num", "1", "--worker_num", "1", "train.py"], tmp_path, timeout=120)
    logs = "".join(p.read_text()[-2000:] for p in sorted((tmp_path / "log").glob("*log.*")))
    assert result.returncode == 0, result.stderr[-3000:] + logs

    # The saved state_dict loads into the snippet's model, and 10 epochs of 3 steps trained it (here
    # from 0.125 to 0.875 of the examples right, the loss from 2.34 to 1.33).
    trained = snippet_model()
    trained.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    data = the_dataset()
    start_accuracy, start_loss = accuracy_and_loss(snippet_model(), data)
    accuracy, loss = accuracy_and_loss(trained, data)
    assert loss < 0.75 * start_loss, (start_loss, loss)
    assert accuracy > 0.6 > start_accuracy, (start_accuracy, accuracy)


@pytest.mark.timeout(100)  # 10-20 s: Python importing torch and the packages
def test_the_readme_api_started_alone_says_it_needs_ps_launch(tmp_path):
    (tmp_path / "train.py").write_text(DATASET + readme_snippet())
    # No role variables of any engine: only what runs Python.
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR", "PYTHONPATH")}
    result = subprocess.run(
        [sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90
    )
    assert result.returncode == 1
    last = result.stderr.strip().rsplit("\n", 1)[-1]
    assert "run under ps-launch" in last, result.stderr[-2000:]  # its message, not a traceback
    assert not (tmp_path / "model.pt").exists()
