"""The flat block store against torch's optimizer block by block: bit-identical blocks and state, checkpoints.

``BlockStore`` holds a pserver's blocks as views of one flat tensor and updates
them with one call of torch's functional optimizer (``pserver.flat_optim``). The
reference here is what the store did before: one leaf tensor per block, a
``torch.optim`` optimizer over them, a gradient set as ``.grad`` on the blocks a
push holds and ``step()`` at the scheduled learning rate. After every step the
blocks and every state tensor must be equal bit for bit (and of the same dtype and
shape), for each optimizer and its options, with some steps missing some blocks
(torch skips those, state and step count unchanged). A checkpoint written by
either loads into the other and training goes on equal.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from torch import nn

from pserver.flat import FlatGrad
from pserver.store import BlockStore
from transpiler import DistributeTranspiler, DistributeTranspilerConfig, Program
from transpiler.optim import LrSchedule

EPS = ["127.0.0.1:1", "127.0.0.1:2"]
# Shapes no multiple of 16 (the 64-byte padding in float32), a scalar, one past torch's grain of 32768
# elements (its kernels split it over threads), one of exactly 16 elements.
SHAPES = [(7, 3), (), (33,), (211, 171), (5, 5, 5), (16,), (1,), (97, 200), (40, 19)]


class Blocks(nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.p = nn.ParameterList(nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in SHAPES)


def store_of(name: str, kwargs: dict, dtype=torch.float32, pservers: int = 1, shard: int = 0, **program):
    """The BlockStore of pserver ``shard`` (of ``pservers``) for the Blocks model under optimizer ``name``."""
    prog = Program(Blocks(dtype), name, **kwargs, **program)
    t = DistributeTranspiler(DistributeTranspilerConfig())
    t.transpile(0, program=prog, pservers=",".join(EPS[:pservers]), trainers=2, sync_mode=True)
    ps = t.get_pserver_program(EPS[shard])
    store = BlockStore(ps, t.get_startup_program(EPS[shard], ps))
    SPECS[id(store)] = ps.optimizer
    return store


SPECS: dict = {}  # id(store) -> the optimizer spec it was built with


class Reference:
    """The store as it was: a leaf tensor per block and torch's optimizer over them."""

    def __init__(self, store: BlockStore):
        self.blocks = {n: b.detach().clone().requires_grad_(True) for n, b in store.blocks.items()}
        spec = SPECS[id(store)]
        self.optimizer = spec.build(self.blocks.values())
        self.schedule = LrSchedule(spec)

    def apply(self, grads, step: int) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.schedule.lr_at(step)
        for name, g in grads.items():
            self.blocks[name].grad = g
        self.optimizer.step()
        for name in grads:
            self.blocks[name].grad = None

    def state(self, name: str) -> dict:
        return self.optimizer.state.get(self.blocks[name], {})


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same dtype, shape and bits (so -0.0 is not 0.0, and a NaN where the other has the same NaN)."""
    bits = _BITS[a.element_size()]
    return (a.dtype, a.shape) == (b.dtype, b.shape) and torch.equal(
        a.detach().reshape(-1).view(bits), b.detach().reshape(-1).view(bits)
    )


def assert_same(store: BlockStore, ref: Reference) -> None:
    """Blocks and optimizer state equal bit for bit, with the same keys, dtypes and shapes."""
    for name, block in store.blocks.items():
        assert same(block, ref.blocks[name]), name
        mine, theirs = store.block_state(name), ref.state(name)
        assert list(mine) == list(theirs), name
        for key, value in theirs.items():
            assert same(mine[key], value), (name, key)


def gradients(store: BlockStore, rng: np.random.Generator, some_absent: bool):
    """Random gradients of the blocks (a few absent when ``some_absent``): by name, and as a flat tensor
    whose absent blocks hold NaN (never read) with the presence mask."""
    layout = store.flat_layout
    flat = torch.full((layout.numel,), float("nan"), dtype=layout.dtype)
    present = rng.random(len(layout)) < 0.6 if some_absent else np.ones(len(layout), dtype=bool)
    # The padding between blocks is zero, as a push's is.
    pad = torch.ones(layout.numel, dtype=torch.bool)
    for i in range(len(layout)):
        pad[layout.starts[i] : layout.starts[i] + layout.dense.numels[i]] = False
    flat[pad] = 0
    named = {}
    for i, name in enumerate(layout.names):
        if present[i]:
            scale = 10.0 ** rng.integers(-3, 2)
            g = torch.from_numpy(np.asarray(rng.standard_normal(layout.shapes[i]) * scale)).to(layout.dtype)
            layout.view(i, flat).copy_(g)
            named[name] = g.clone()
        else:
            layout.view(i, flat).fill_(float("nan"))
    return named, flat, present


CASES = [
    ("sgd", {"lr": 0.1}),
    ("sgd", {"lr": 0.1, "weight_decay": 0.01, "maximize": True}),
    ("momentum", {"lr": 0.1}),
    ("momentum", {"lr": 0.1, "dampening": 0.1, "weight_decay": 0.01}),
    ("momentum", {"lr": 0.1, "nesterov": True, "maximize": True}),
    ("adam", {"lr": 0.01}),
    ("adam", {"lr": 0.01, "weight_decay": 0.01, "amsgrad": True}),
    ("adam", {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6, "maximize": True}),
    ("adam", {"lr": 0.01, "eps": 0.0}),
    ("adamw", {"lr": 0.01, "weight_decay": 0.1}),
    ("adamw", {"lr": 0.01, "amsgrad": True, "maximize": True}),
    ("adagrad", {"lr": 0.1}),
    ("adagrad", {"lr": 0.1, "lr_decay": 0.01, "weight_decay": 0.01, "initial_accumulator_value": 0.1}),
    ("adagrad", {"lr": 0.1, "maximize": True, "eps": 1e-6}),
    ("rmsprop", {"lr": 0.01}),
    ("rmsprop", {"lr": 0.01, "centered": True, "momentum": 0.9, "weight_decay": 0.01}),
    ("rmsprop", {"lr": 0.01, "alpha": 0.9, "momentum": 0.5, "maximize": True}),
]
SCHEDULES = [
    (
        "momentum",
        {"lr": 0.1},
        {"lr_scheduler": "StepLR", "lr_scheduler_kwargs": {"step_size": 2, "gamma": 0.5}},
    ),
    ("adam", {"lr": 0.01}, {"lr_scheduler": "CosineAnnealingLR", "lr_scheduler_kwargs": {"T_max": 5}}),
]
# Three steps of every block (one call over the whole buffer), then absent blocks at these steps: some
# blocks start late (SGD's momentum, Adam's state), counts drift apart, then every block again (the counts
# stay apart: the per-block path goes on).
ABSENT_AT = {3, 4, 6}


def run(store: BlockStore, ref: Reference, steps: int, flat: bool, seed: int = 0, absent=ABSENT_AT) -> None:
    rng = np.random.default_rng(seed)
    for step in range(steps):
        named, grad, present = gradients(store, rng, step in absent)
        ref.apply(named, step)
        if flat:
            store.apply_flat(grad, None if present.all() else present, step)
        else:
            store.apply(named, step)
        assert_same(store, ref)


@pytest.mark.parametrize("name,kwargs", CASES, ids=[f"{n}-{'-'.join(k)}" for n, k in CASES])
@pytest.mark.parametrize("flat", [True, False], ids=["apply_flat", "apply"])
def test_every_optimizer_equals_torch_block_by_block(name, kwargs, flat):
    store = store_of(name, kwargs)
    ref = Reference(store)
    optimizer, whole = store._groups[0].optimizer, []
    step_all = optimizer._step_all
    optimizer._step_all = lambda *a: (whole.append(1), step_all(*a))
    run(store, ref, 8, flat)
    # A flat gradient: the whole buffer in one call for the first three steps (and on, where nothing is
    # kept per block); a zero eps keeps to the blocks, as gradients by name do (one call over the views).
    assert len(whole) >= 3 if flat and kwargs.get("eps") != 0 else not whole


@pytest.mark.parametrize("name,kwargs,program", SCHEDULES, ids=[c[0] for c in SCHEDULES])
def test_an_lr_schedule_equals_torch(name, kwargs, program):
    store = store_of(name, kwargs, **program)
    ref = Reference(store)
    run(store, ref, 6, flat=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name,kwargs", [CASES[4], CASES[6], CASES[12], CASES[15]], ids=lambda c: str(c))
def test_other_dtypes_equal_torch(dtype, name, kwargs):
    store = store_of(name, kwargs, dtype=dtype)
    ref = Reference(store)
    run(store, ref, 5, flat=True)


def test_one_call_updates_every_block_while_all_are_pushed_and_alike():
    """The whole-buffer call runs while every block has a gradient and one count: then its step tensor
    is the blocks' count."""
    store = store_of("adam", {"lr": 0.01})
    ref = Reference(store)
    run(store, ref, 3, flat=True, absent=())
    optimizer = store._groups[0].optimizer
    assert optimizer._alike and optimizer._step.item() == 3.0 and optimizer.steps.eq(3).all()
    run(store, ref, 1, flat=True, absent={0})  # some block skipped: apart, the per-block path from here
    assert not optimizer._alike or optimizer.steps.eq(4).all()


def test_padding_between_blocks_stays_zero():
    store = store_of("adam", {"lr": 0.1, "weight_decay": 0.1, "maximize": True})
    run(store, Reference(store), 3, flat=True, absent=())
    layout, flat = store.flat_layout, store.flat
    inside = torch.zeros(layout.numel, dtype=torch.bool)
    for i in range(len(layout)):
        inside[layout.starts[i] : layout.starts[i] + layout.dense.numels[i]] = True
    assert (~inside).any() and flat[~inside].eq(0).all()
    assert all(b.data_ptr() == layout.view(i, flat).data_ptr() for i, b in enumerate(store.blocks.values()))
    assert store.layout.offsets == layout.dense.offsets  # the wire's layout, byte for byte


def test_a_sync_mean_is_applied_as_it_is():
    """The sync step's mean (a FlatGrad of the store's layout) goes to apply_flat without a copy by name."""
    store = store_of("sgd", {"lr": 0.5})
    ref = Reference(store)
    sums = store.dense_sums()
    rng = np.random.default_rng(1)
    named, grad, present = gradients(store, rng, some_absent=True)
    sums.add_flat(grad, present)
    mean = sums.mean(1)
    assert isinstance(mean, FlatGrad) and sorted(mean) == sorted(named)
    store.apply(mean, 0)
    ref.apply(named, 0)
    assert_same(store, ref)


def test_geo_adds_the_scaled_deltas():
    """What GEO's handler (pserver/engine/modes/geo_deltas.py) applies a push as: deltas times its scale."""
    store = store_of("sgd", {"lr": 0.1}, dtype=torch.float32)
    prog = Program(Blocks(torch.float32), "sgd", lr=0.1)
    t = DistributeTranspiler(DistributeTranspilerConfig(k_steps=4))
    t.transpile(0, program=prog, pservers=EPS[0], trainers=4, sync_mode=False)
    ps = t.get_pserver_program(EPS[0])
    store = BlockStore(ps, t.get_startup_program(EPS[0], ps))
    expect = {n: b.detach().clone() for n, b in store.blocks.items()}
    rng = np.random.default_rng(2)
    for step in range(4):
        named, grad, present = gradients(store, rng, some_absent=step % 2 == 1)
        for name, delta in named.items():
            expect[name].add_(delta, alpha=0.25)
        if step < 2:
            store.add_flat(grad, None if present.all() else present, 0.25)
        else:
            store.add(named, 0.25)
        for name, block in store.blocks.items():
            assert same(block, expect[name]), name
    assert all(s["state"] == {} for s in store.saved_blocks().values())


def test_a_wrong_flat_gradient_is_refused():
    store = store_of("sgd", {"lr": 0.1})
    n = store.flat_layout.numel
    with pytest.raises(ValueError, match="flat gradient"):
        store.apply_flat(torch.zeros(n - 1), None, 0)
    with pytest.raises(ValueError, match="flat gradient"):
        store.apply_flat(torch.zeros(n, dtype=torch.float64), None, 0)
    with pytest.raises(ValueError, match="presence"):
        store.apply_flat(torch.zeros(n), np.ones(3, dtype=bool), 0)


# -- checkpoints: today's format, both ways ------------------------------------------------------


def torch_saved(store: BlockStore, ref: Reference) -> dict:
    """What the per-block store wrote: each block's rows, value, and torch's optimizer state of it."""
    return {
        name: {
            "param": store.specs[name].param,
            "row_start": store.specs[name].row_start,
            "row_end": store.specs[name].row_end,
            "value": ref.blocks[name].detach().clone(),
            "state": {k: v.clone() if torch.is_tensor(v) else v for k, v in ref.state(name).items()},
        }
        for name in store.blocks
    }


def by_param(*saved: dict) -> dict:
    """A checkpoint's blocks as ``load_blocks`` gives them (through torch.save and load, weights only)."""
    out = {}
    for part in saved:
        buffer = io.BytesIO()
        torch.save(part, buffer)
        buffer.seek(0)
        for entry in torch.load(buffer, weights_only=True).values():
            out.setdefault(entry["param"], []).append(entry)
    for entries in out.values():
        entries.sort(key=lambda e: e["row_start"])
    return out


def assert_saved_equal(mine: dict, theirs: dict) -> None:
    assert mine.keys() == theirs.keys()
    for name in theirs:
        a, b = mine[name], theirs[name]
        assert {k: a[k] for k in ("param", "row_start", "row_end")} == {
            k: b[k] for k in ("param", "row_start", "row_end")
        }
        assert same(a["value"], b["value"]), name
        assert list(a["state"]) == list(b["state"]), name
        for key, value in b["state"].items():
            assert same(a["state"][key], value), (name, key)


@pytest.mark.parametrize("name,kwargs", [CASES[3], CASES[6], CASES[12], CASES[15], CASES[0]], ids=str)
def test_a_checkpoint_of_torch_blocks_loads_and_training_goes_on_equal(name, kwargs):
    """Today's checkpoint (a plain torch optimizer's state per block, some blocks never stepped) into the
    flat store: it saves the same, and trains on equal."""
    before = store_of(name, kwargs)
    ref = Reference(before)
    rng = np.random.default_rng(5)
    for step in range(3):  # block 0 never pushed: no state; the others apart
        named, _, _ = gradients(before, rng, some_absent=True)
        named.pop(before.flat_layout.names[0], None)
        ref.apply(named, step)
    saved = torch_saved(before, ref)
    store = store_of(name, kwargs)
    store.restore(by_param(saved))
    assert_saved_equal(store.saved_blocks(), saved)
    assert_same(store, ref)
    run(store, ref, 4, flat=True, seed=9, absent={1})


@pytest.mark.parametrize("name,kwargs", [CASES[3], CASES[7], CASES[13], CASES[16]], ids=str)
def test_a_flat_checkpoint_loads_into_torch_blocks(name, kwargs):
    """The flat store's checkpoint into a plain torch optimizer, as the per-block store restored it
    (``optimizer.state[block] = state``): training goes on equal."""
    store = store_of(name, kwargs)
    ref = Reference(store)
    run(store, ref, 3, flat=True, absent={1})
    saved = by_param(store.saved_blocks())
    fresh = Reference(store_of(name, kwargs))
    with torch.no_grad():
        for block_name, block in fresh.blocks.items():
            (entry,) = saved[store.specs[block_name].param]
            block.copy_(entry["value"])
            if entry["state"]:
                fresh.optimizer.state[block] = entry["state"]
    assert_same(store, fresh)
    rng = np.random.default_rng(11)
    for step in range(3, 6):
        named, grad, present = gradients(store, rng, some_absent=step == 4)
        fresh.apply(named, step)
        store.apply_flat(grad, None if present.all() else present, step)
        assert_same(store, fresh)


def test_a_checkpoint_of_another_slicing_restores():
    """Two pservers' blocks into one pserver's whole parameters: values and state cut and joined."""
    halves = [store_of("adam", {"lr": 0.01}, pservers=2, shard=s) for s in (0, 1)]
    rng = np.random.default_rng(4)
    for step in range(2):
        for half in halves:
            half.apply_flat(gradients(half, rng, some_absent=False)[1], None, step)
    whole = store_of("adam", {"lr": 0.01})
    whole.restore(by_param(*(h.saved_blocks() for h in halves)))
    split = 0
    for name, block in whole.blocks.items():
        param = whole.specs[name].param
        pieces = sorted(
            ((h, n) for h in halves for n in h.blocks if h.specs[n].param == param),
            key=lambda p: p[0].specs[p[1]].row_start,
        )
        split += len(pieces) > 1

        def joined(get):
            parts = [get(h, n) for h, n in pieces]
            return parts[0] if len(parts) == 1 else torch.cat(parts)

        assert same(block, joined(lambda h, n: h.blocks[n])), name
        state = whole.block_state(name)
        assert state["step"].item() == 2.0
        for key in ("exp_avg", "exp_avg_sq"):
            assert same(state[key], joined(lambda h, n: h.block_state(n)[key])), (name, key)
    assert split >= 2  # the plan did cut some parameters in two


def test_a_checkpoint_that_does_not_fit_changes_nothing():
    store = store_of("adam", {"lr": 0.01})
    run(store, Reference(store), 2, flat=True, absent=())
    saved = store.saved_blocks()
    before = {n: b.clone() for n, b in store.blocks.items()}
    broken = {
        n: dict(e, state={k: v for k, v in e["state"].items() if k != "exp_avg_sq"}) for n, e in saved.items()
    }
    for entry in broken.values():
        entry["value"] = entry["value"] + 1
    with pytest.raises(ValueError, match="exp_avg_sq"):
        store.restore(by_param(broken))
    assert all(torch.equal(b, before[n]) for n, b in store.blocks.items())
