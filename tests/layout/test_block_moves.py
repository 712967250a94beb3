"""Moving dense blocks to the next layout: each pserver's next blocks, built from what it keeps and the
pieces the others send it, equal a checkpoint of every pserver loaded into the next slicing (values and
optimizer state), and the pieces are only the rows that change pserver."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pserver.layout.block_moves import next_blocks, pieces_to
from pserver.store import BlockStore
from transpiler import DistributeTranspiler, DistributeTranspilerConfig, Program
from transpiler.layout.change import next_pserver_program
from transpiler.layout.moves import block_pieces
from transpiler.placement import by_param

EPS = ["127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:7003"]


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 2048), nn.ReLU(), nn.Linear(2048, 5), nn.Linear(5, 1))


def trained_stores(pservers, optimizer, split_method):
    t = DistributeTranspiler(DistributeTranspilerConfig(min_block_size=8192, split_method=split_method))
    t.transpile(0, program=Program(model(), optimizer, lr=0.05), pservers=",".join(pservers), trainers=1)
    stores = {ep: BlockStore(t.get_pserver_program(ep), t.get_startup_program(ep)) for ep in pservers}
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        for store in stores.values():
            store.apply({n: torch.randn(b.shape, generator=gen) for n, b in store.blocks.items()}, step)
    return t, stores


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam", "adagrad"])
@pytest.mark.parametrize("now, nxt, split", [(2, 3, "RoundRobin"), (3, 2, "RoundRobin"), (2, 3, "HashName")])
def test_next_blocks_from_kept_and_received_pieces_equal_a_re_sharded_checkpoint(optimizer, now, nxt, split):
    t, stores = trained_stores(EPS[:now], optimizer, split)
    saved = {ep: s.saved_blocks() for ep, s in stores.items()}
    program = t.get_pserver_program(EPS[0])
    plans = {ep: next_pserver_program(program, EPS[:nxt], ep) for ep in EPS[:nxt]}
    pieces = block_pieces(program.params, plans[EPS[0]].params)
    moved_rows = sum(p.row_end - p.row_start for p in pieces)
    assert 0 < moved_rows < sum(p.shape[0] for p in program.params if p.shape)
    for ep, plan in plans.items():
        received = [pieces_to(saved[src], pieces, ep) for src in saved if src != ep]
        got = next_blocks(plan, saved.get(ep, {}), received)
        want = BlockStore(plan, None)
        want.restore(by_param(saved.values()))
        assert got.blocks.keys() == want.blocks.keys()
        for name in got.blocks:
            torch.testing.assert_close(got.blocks[name], want.blocks[name], rtol=0, atol=0)
            a, b = got.block_state(name), want.block_state(name)
            assert a.keys() == b.keys()
            for key in a:
                torch.testing.assert_close(torch.as_tensor(a[key]), torch.as_tensor(b[key]), rtol=0, atol=0)
        # Only rows from other pservers travel, and no more than the pieces name.
        sent = sum(e["row_end"] - e["row_start"] for r in received for e in r.values())
        assert sent == sum(p.row_end - p.row_start for p in pieces if p.to == ep)


def test_a_pserver_missing_a_piece_is_refused():
    t, stores = trained_stores(EPS[:2], "adam", "RoundRobin")
    program = t.get_pserver_program(EPS[0])
    plan = next_pserver_program(program, EPS[:3], EPS[2])
    with pytest.raises(ValueError, match="holds no rows"):
        next_blocks(plan, {}, [])
