"""Gradients pushed in a narrower wire dtype (``grad_wire_dtype``): half the bytes, one rounding.

The trainer casts each float gradient to bfloat16/float16 before the push,
the pserver widens each piece back on arrival; parameters, optimizer state and
pulls stay in the model's dtype. So sync training must equal single-process
training in which each trainer's gradient is rounded to the wire dtype before
the trainers' mean, exactly, and the pushes must carry half the bytes.
"""

import numpy as np
import pytest
import torch
from torch import nn

from harness.cluster import LocalCluster
from harness.models import FLOAT64_EXACT, batches, odd_mlp, train_concatenated
from psproto import ps_pb2
from psproto.codec import TensorReader, WireError, decode_chunk, encode_chunks, widen
from tests.helpers.table_models import BAG_VOCAB, VOCAB, single_process, table_batches, table_program
from trainer.transport.narrowing import GradientNarrower
from transpiler import DistributeTranspilerConfig, Program
from transpiler.tables import initial_rows

WIRE = {"bfloat16": torch.bfloat16, "float16": torch.float16}


# -- the codec: pieces of whole elements, widened on arrival -----------------------------------


def _pieces(tensors, chunk_bytes):
    return [
        p
        for m in encode_chunks(ps_pb2.PushHeader(), tensors, chunk_bytes)
        for p in decode_chunk(m, ps_pb2.PushHeader)[1]
    ]


@pytest.mark.parametrize("chunk_bytes", [4096, 4097, 4099, 5000])
def test_pieces_hold_whole_elements_and_at_most_a_chunk(chunk_bytes):
    g = torch.Generator().manual_seed(1)
    tensors = [
        ("a", torch.randn(3001, generator=g)),
        ("ids", torch.arange(999)),
        ("h", torch.randn(2049, generator=g).to(torch.bfloat16)),
        ("d", torch.randn(777, generator=g).double()),
    ]
    sizes = {n: t.element_size() for n, t in tensors}
    messages = list(encode_chunks(ps_pb2.PushHeader(), tensors, chunk_bytes))
    current = None
    for m in messages:
        pieces = decode_chunk(m, ps_pb2.PushHeader)[1]
        assert sum(len(p.data) for p in pieces) <= chunk_bytes
        for p in pieces:
            current = p.name or current
            assert p.offset % sizes[current] == 0 and len(p.data) % sizes[current] == 0, (current, p.offset)
    expect = {n: (str(t.dtype)[6:], list(t.shape)) for n, t in tensors}
    reader = TensorReader(expect.get)
    for p in _pieces(tensors, chunk_bytes):
        reader.add(p)
    out = reader.finish()
    for n, t in tensors:
        assert torch.equal(out[n], t), n


@pytest.mark.parametrize("wire", sorted(WIRE))
@pytest.mark.parametrize("block_dtype", [torch.float32, torch.float64])
def test_a_narrowed_gradient_is_widened_exactly_into_the_pooled_block(wire, block_dtype):
    g = torch.Generator().manual_seed(2)
    grad = torch.randn(70, 33, generator=g, dtype=block_dtype) * 3
    sent = grad.to(WIRE[wire])
    dest = torch.full((70, 33), float("nan"), dtype=block_dtype)
    reader = TensorReader(lambda n: (str(block_dtype)[6:], [70, 33]), dest=lambda n: dest, widen=True)
    for p in _pieces([("w.block0", sent)], 4096):  # several pieces
        reader.add(p)
    out = reader.finish()
    assert out["w.block0"] is dest and reader.nbytes == sent.numel() * 2
    assert torch.equal(dest, sent.to(block_dtype))


def test_widen_is_the_exact_cast_for_every_bfloat16_bit_pattern():
    bits = np.arange(1 << 16, dtype=np.uint16)
    out = np.empty(1 << 16, np.float32)
    widen(memoryview(bits.tobytes()), "bfloat16", out)
    expected = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().numpy()
    assert np.array_equal(out.view(np.uint32), expected.view(np.uint32))  # NaNs and -0.0 bit for bit


@pytest.mark.parametrize(
    "widens,sent,expected,match",
    [
        (False, torch.bfloat16, "float32", r"dtype 'bfloat16', expected 'float32'$"),  # pulls never narrow
        (True, torch.int32, "float32", r"expected 'float32' or one of \('bfloat16', 'float16'\)"),
        (
            True,
            torch.float32,
            "bfloat16",
            r"dtype 'float32', expected 'bfloat16'$",
        ),  # never narrower than sent
        (True, torch.bfloat16, "int64", r"dtype 'bfloat16', expected 'int64'$"),
    ],
)
def test_a_reader_refuses_dtypes_it_cannot_widen(widens, sent, expected, match):
    reader = TensorReader(lambda n: (expected, [4]), widen=widens)
    (piece,) = _pieces([("t", torch.ones(4).to(sent))], 4096)
    with pytest.raises(WireError, match=match):
        reader.add(piece)


def test_a_narrowed_piece_that_cuts_an_element_is_refused():
    reader = TensorReader(lambda n: ("float32", [4]), widen=True)
    data = torch.ones(4, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    with pytest.raises(WireError, match="a piece of 3 bytes at byte 0 cuts an element"):
        reader.add(ps_pb2.TensorPiece(name="t", dtype="bfloat16", shape=[4], offset=0, data=data[:3]))


# -- the trainer's narrowing ----------------------------------------------------------------


def test_narrower_casts_wider_floats_into_reused_buffers_and_leaves_the_rest():
    n = GradientNarrower("bfloat16")
    grads = [
        ("w.block0", torch.randn(5, 3)),
        ("emb@ids", torch.arange(4)),
        ("h.block0", torch.ones(2, dtype=torch.float16)),
        ("d.block0", torch.randn(3, dtype=torch.float64)),
    ]
    first = n.narrow("ep0", grads)
    assert [t.dtype for _, t in first] == [torch.bfloat16, torch.int64, torch.float16, torch.bfloat16]
    assert torch.equal(first[0][1], grads[0][1].to(torch.bfloat16)) and first[1][1] is grads[1][1]
    again = n.narrow("ep0", [("w.block0", torch.zeros(5, 3))])
    assert again[0][1].data_ptr() == first[0][1].data_ptr() and again[0][1].abs().sum() == 0
    assert n.narrow("ep1", grads[:1])[0][1].data_ptr() != first[0][1].data_ptr()  # one buffer per pserver
    assert GradientNarrower(None).narrow("ep0", grads) is grads


def test_config_refuses_other_wire_dtypes_and_local_sgd_with_one():
    with pytest.raises(ValueError, match="grad_wire_dtype must be one of"):
        DistributeTranspilerConfig(grad_wire_dtype="int8")
    with pytest.raises(ValueError, match="grad_wire_dtype and use_local_sgd"):
        DistributeTranspilerConfig(mode="collective", use_local_sgd=True, grad_wire_dtype="bfloat16")


# -- sync training through pservers ---------------------------------------------------------

STEPS, PER_TRAINER = 4, 8


def program(dtype):
    return Program(odd_mlp(dtype=dtype), "momentum", lr=0.05, momentum=0.9, weight_decay=0.01)


def rounded_reference(dtype, wire, data):
    """One process: each trainer's gradient on its own batch, rounded to ``wire``, then their mean."""
    prog = program(dtype)
    model, opt = prog.model, prog.optimizer.build(prog.model.parameters())
    for step_batches in data:
        grads = []
        for x, y in step_batches:
            model.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            grads.append([p.grad.to(wire).to(dtype) for p in model.parameters()])
        for p, gs in zip(model.parameters(), zip(*grads)):
            p.grad = (gs[0] + gs[1]) / 2  # the sync engine's sum of two pushes, then / 2
        opt.step()
    return model.state_dict()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("wire", sorted(WIRE))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sync_with_a_narrow_wire_equals_single_process_with_rounded_gradients(wire, dtype):
    data = batches(2, PER_TRAINER, STEPS, dtype=dtype)
    config = DistributeTranspilerConfig(grad_wire_dtype=wire)
    with LocalCluster(lambda: program(dtype), 2, 2, config=config) as cluster:

        def body(tr, i):
            for step_batches in data:
                x, y = step_batches[i]
                nn.functional.cross_entropy(tr.model(x), y).backward()
                tr.step()
            return tr.state_dict(), tr.channels.bytes_pushed

        results = cluster.run_trainers(body)
        received = sum(s.servicer.counters.bytes_in for s in cluster.servers)
    expected = rounded_reference(dtype, WIRE[wire], data)
    numel = sum(p.numel() for p in odd_mlp().parameters())
    tolerance = FLOAT64_EXACT if dtype == torch.float64 else dict(rtol=1e-6, atol=1e-7)
    for state, pushed in results.values():
        assert pushed == STEPS * numel * 2  # two bytes a gradient element, whatever the model's dtype
        for name in expected:
            torch.testing.assert_close(state[name], expected[name], **tolerance, msg=name)
    assert received == 2 * STEPS * numel * 2
    # The rounding is real: exact training ends close by, but elsewhere.
    exact = train_concatenated(program(dtype), data)["fc2.weight"]
    assert not torch.equal(expected["fc2.weight"], exact)
    torch.testing.assert_close(expected["fc2.weight"], exact, rtol=0, atol=2e-3)


def assert_update_within_rounding(got, ref, initial, what):
    """``got`` made ``ref``'s update from ``initial``, each row to within 2**-6 of that row's own movement.

    bfloat16 keeps 8 significant bits: each pushed gradient is off by at most 2**-9, relative, and over
    the steps the rows' and the head's roundings feed each other (1.8 * 2**-8 seen at most). Relative
    to the update, not to the values: an update that did nothing fails however small it should have
    been, and a row the data never looked up must stay exactly where it was.
    """
    moved, ref_moved = got - initial, ref - initial
    scale = ref_moved.abs().amax(dim=-1, keepdim=True)
    err = (moved - ref_moved).abs()
    worst = torch.where(err == 0, 0.0, err / scale).max().item()  # inf: a row that must stay put moved
    assert bool((err <= 2**-6 * scale).all()), f"{what}: an update off by {worst:.3g} of its row's movement"


@pytest.mark.timeout(60)
def test_table_row_gradients_travel_narrow_and_train_within_its_rounding():
    data = table_batches(2, PER_TRAINER, STEPS)
    build = lambda: table_program("sgd", torch.float32, lr=0.5)  # noqa: E731
    with LocalCluster(build, 2, 2, config=DistributeTranspilerConfig(grad_wire_dtype="bfloat16")) as cluster:

        def body(tr, i):
            for step_batches in data:
                ids, bag, y = step_batches[i]
                nn.functional.cross_entropy(tr.model(ids, bag), y).backward()
                tr.step()
            narrowed = {name: t.dtype for (_, name), t in tr.channels.narrower._buffers.items()}
            rows = {
                "emb": tr.pull_rows("emb", torch.from_numpy(VOCAB)),
                "bag": tr.pull_rows("bag", torch.from_numpy(BAG_VOCAB)),
            }
            return tr.state_dict(), rows, narrowed

        results = cluster.run_trainers(body)
    ref_state, ref_rows = single_process(build(), data)
    prog = build()
    initial_state = {k: v for k, v in prog.model.state_dict().items() if k in ref_state}
    vocab = {"emb": VOCAB, "bag": BAG_VOCAB}
    initial = {t.name: torch.from_numpy(initial_rows(t, vocab[t.name])) for t in prog.tables}
    looked_up = {
        "emb": np.unique(np.concatenate([b[0].flatten() for sb in data for b in sb])),
        "bag": np.unique(np.concatenate([b[1].flatten() for sb in data for b in sb])),
    }
    for name, ids in looked_up.items():  # the reference moved exactly the rows the data looked up
        assert torch.equal(
            (ref_rows[name] != initial[name]).any(dim=1), torch.from_numpy(np.isin(vocab[name], ids))
        )
    for state, rows, narrowed in results.values():
        assert narrowed["emb@rows"] == narrowed["bag@rows"] == torch.bfloat16
        for name in rows:
            assert_update_within_rounding(rows[name], ref_rows[name], initial[name], f"table {name}")
        for name in ref_state:
            assert_update_within_rounding(state[name], ref_state[name], initial_state[name], name)
