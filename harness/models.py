"""Small models and data shared by the tests and the GPU check (benchmarks/gpu_check): the odd-sized MLP,
its batches, and the single-process references a distributed run must equal."""

import torch
from torch import nn

# assert_close's tolerance for "float64 training equals the single-process reference": a mean of
# per-trainer gradients and the gradient of the concatenated batch differ by a few ulps, which Adam
# and Adagrad carry into a few 1e-15 after 4 steps (4e-15 at most seen, on parameters of order 1).
# A real difference in the update (a lost or doubled push, a wrong scale) is orders above it.
FLOAT64_EXACT = dict(rtol=1e-12, atol=1e-12)
# The same over a whole job of tests/scripts/recovery_job.py run with --dtype float64 (40 to 1200 steps
# of momentum): 2e-16 to 1.2e-15 seen on its 512-wide model, 6.5e-14 on its 57344-wide one (5.7e-14 with
# ATen's and MKL's other kernels). In float32 the same drift reached 1e-6 and 1.2e-4, by amounts that
# depend on the CPU's kernels. A real difference (a lost or doubled push) is orders above either.
FLOAT64_JOB = dict(rtol=0, atol=1e-10)


class OddMLP(nn.Module):
    """Parameters whose sizes are no multiples of the block size, plus a scalar.

    With min_block_size=8192: fc1.weight (453x37=16761) cuts into 2 blocks,
    fc2.weight (61x453=27633) into up to 3, biases and the scalar stay whole.
    """

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(37, 453)
        self.fc2 = nn.Linear(453, 61)
        self.head = nn.Linear(61, 5)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        h = torch.relu(self.fc2(h))
        return self.head(h) * self.scale


def odd_mlp(seed: int = 0, dtype: torch.dtype = torch.float32) -> OddMLP:
    torch.manual_seed(seed)
    return OddMLP().to(dtype)


def batches(n_trainers: int, per_trainer: int, steps: int, seed: int = 7, dtype: torch.dtype = torch.float32):
    """``steps`` lists of per-trainer (x, y) batches for OddMLP."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randn(n_trainers * per_trainer, 37, generator=g, dtype=dtype)
        y = torch.randint(0, 5, (n_trainers * per_trainer,), generator=g)
        out.append(
            [
                (x[i * per_trainer : (i + 1) * per_trainer], y[i * per_trainer : (i + 1) * per_trainer])
                for i in range(n_trainers)
            ]
        )
    return out


def train_concatenated(prog, data) -> dict:
    """Plain torch on the concatenation of every trainer's batches, step by step: the sync reference.

    ``prog`` is a dense Program; ``data`` as :func:`batches` makes it. Returns the final state_dict.
    """
    model = prog.model
    opt = prog.optimizer.build(model.parameters())
    sched = None
    if prog.optimizer.lr_scheduler:
        sched = getattr(torch.optim.lr_scheduler, prog.optimizer.lr_scheduler)(
            opt, **prog.optimizer.lr_scheduler_kwargs
        )
    for step_batches in data:
        x = torch.cat([b[0] for b in step_batches])
        y = torch.cat([b[1] for b in step_batches])
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if sched:
            sched.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def odd_program():
    """A Program for ``ps-server --program harness/models.py:odd_program``."""
    from transpiler import Program

    return Program(odd_mlp(dtype=torch.float64), "adam", lr=0.01, weight_decay=0.01)


def assert_state_close(state: dict, expected: dict, atol: float = 1e-5) -> None:
    """Same keys, and every tensor within ``atol`` of the expected one (no relative tolerance)."""
    assert state.keys() == expected.keys()
    for k in expected:
        torch.testing.assert_close(state[k], expected[k], rtol=0, atol=atol, msg=lambda m: f"{k}: {m}")


def train_distributed(cluster, data) -> dict:
    """Every trainer of ``cluster`` (a LocalCluster) trains its share of ``data`` (as :func:`batches`
    makes it) with cross-entropy, one ``tr.step()`` per step; their final state_dicts by trainer id."""

    def body(tr, i):
        for step_batches in data:
            x, y = step_batches[i]
            nn.functional.cross_entropy(tr.model(x), y).backward()
            tr.step()
        return tr.state_dict()

    return cluster.run_trainers(body)
