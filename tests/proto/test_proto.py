"""The generated modules match ps.proto; the wire codec cuts and rebuilds tensors."""

import os
import subprocess
import sys
import tempfile

import pytest
import torch
from google.protobuf import descriptor_pb2

from psproto import ps_pb2, ps_pb2_grpc
from psproto.codec import TensorReader, WireError, decode_chunk, encode_chunks
from tests.helpers import paths

REPO = str(paths.REPO)


def test_generated_modules_are_fresh():
    """Fails when ps.proto changed and `python proto/generate.py` was not rerun."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as out:
        descriptor_file = os.path.join(out, "ps.desc")
        rc = protoc.main(
            [
                "protoc",
                f"--proto_path=psproto={os.path.join(REPO, 'proto')}",
                f"--descriptor_set_out={descriptor_file}",
                "psproto/ps.proto",
            ]
        )
        assert rc == 0
        with open(descriptor_file, "rb") as f:
            fresh = descriptor_pb2.FileDescriptorSet.FromString(f.read()).file[0]
    # protoc's descriptor set adds derived json_name fields the gencode omits.
    for message in fresh.message_type:
        for field in message.field:
            field.ClearField("json_name")
    committed = descriptor_pb2.FileDescriptorProto.FromString(ps_pb2.DESCRIPTOR.serialized_pb)
    assert committed == fresh, "proto/ps_pb2.py is stale: run `python proto/generate.py`"

    # The gRPC stub module must register exactly the service's methods.
    calls = {}

    class RecordingChannel:
        def __getattr__(self, kind):
            def make(path, request_serializer=None, response_deserializer=None, **_):
                calls[path] = kind

            return make

    ps_pb2_grpc.ParameterServerStub(RecordingChannel())
    service = fresh.service[0]
    expected = {}
    for m in service.method:
        kind = {
            (False, False): "unary_unary",
            (True, False): "stream_unary",
            (False, True): "unary_stream",
            (True, True): "stream_stream",
        }[(m.client_streaming, m.server_streaming)]
        expected[f"/{fresh.package}.{service.name}/{m.name}"] = kind
    assert calls == expected, "proto/ps_pb2_grpc.py is stale: run `python proto/generate.py`"


def test_stubs_work_beside_proto_plus(tmp_path):
    """A package named `proto` (proto-plus's import name) earlier on the path breaks nothing."""
    fake = tmp_path / "proto"
    fake.mkdir()
    (fake / "__init__.py").write_text("PROTO_PLUS = True\n")
    code = "import proto; assert proto.PROTO_PLUS\nimport psproto.ps_pb2, pserver, trainer\nprint('ok')\n"
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def _roundtrip(tensors, chunk_bytes):
    header = ps_pb2.PushHeader(trainer_id=1, step=7, layout_digest="abc")
    messages = list(encode_chunks(header, tensors, chunk_bytes))
    expect = {n: (str(t.dtype).replace("torch.", ""), list(t.shape)) for n, t in tensors}
    reader = TensorReader(expect.get)
    for i, data in enumerate(messages):
        got_header, pieces = decode_chunk(data, ps_pb2.PushHeader)
        assert (got_header == header) if i == 0 else got_header is None
        assert sum(len(p.data) for p in pieces) <= chunk_bytes
        for p in pieces:
            reader.add(p)
    return messages, reader.finish()


def test_pieces_rebuild_tensors_exactly():
    g = torch.Generator().manual_seed(0)
    tensors = [
        ("big", torch.randn(1000, 300, generator=g)),
        ("bias", torch.randn(7, generator=g)),
        ("empty", torch.zeros(0, 5)),
        ("scalar", torch.tensor(2.5, dtype=torch.float64)),
        ("half", torch.randn(33, generator=g).to(torch.bfloat16)),
    ]
    messages, out = _roundtrip(tensors, 4096)
    assert len(messages) == -(-sum(t.numel() * t.element_size() for _, t in tensors) // 4096)
    for name, t in tensors:
        assert out[name].dtype == t.dtype and torch.equal(out[name], t), name


def test_encoding_is_the_protobuf_wire_format_of_ps_proto():
    """What the codec writes, generated protobuf classes read; what they write, the codec reads."""
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    header = ps_pb2.PushHeader(trainer_id=3, step=9, layout_digest="d")
    (data,) = encode_chunks(header, [("w.block0", w), ("b.block0", torch.ones(2))], 1 << 20)
    parsed = ps_pb2.PushChunk.FromString(data)
    reference = ps_pb2.PushChunk(
        header=header,
        pieces=[
            ps_pb2.TensorPiece(name="w.block0", dtype="float32", shape=[2, 3], data=w.numpy().tobytes()),
            ps_pb2.TensorPiece(
                name="b.block0", dtype="float32", shape=[2], data=torch.ones(2).numpy().tobytes()
            ),
        ],
    )
    assert parsed == reference
    # A message from any protobuf encoder (here with a piece at a non-zero offset).
    other = ps_pb2.PullChunk(
        header=ps_pb2.PullHeader(step=4), pieces=[ps_pb2.TensorPiece(offset=12, data=b"x" * 8)]
    )
    got_header, pieces = decode_chunk(other.SerializeToString(), ps_pb2.PullHeader)
    assert got_header.step == 4
    assert pieces[0].offset == 12 and bytes(pieces[0].data) == b"x" * 8 and pieces[0].name == ""


@pytest.mark.parametrize("data", [b"\xff", b"\x12\x05ab", b"\x0a\x02\xff\xff", b"\x0b", b"\x12\x02\x0a\x80"])
def test_decoding_garbage_raises_wire_error(data):
    with pytest.raises(WireError):
        decode_chunk(data, ps_pb2.PushHeader)


def test_small_tensors_share_a_message():
    tensors = [(f"b{i}", torch.full((10,), float(i))) for i in range(20)]
    messages, out = _roundtrip(tensors, 1 << 20)
    assert len(messages) == 1 and len(out) == 20


def test_reader_fills_destination_in_place():
    src = torch.arange(12.0).reshape(3, 4)
    dst = torch.zeros(6, 4)
    view = dst[2:5]
    reader = TensorReader(lambda n: ("float32", [3, 4]), dest=lambda n: view)
    for data in encode_chunks(ps_pb2.PullHeader(), [("w", src)], 16):
        for p in decode_chunk(data, ps_pb2.PullHeader)[1]:
            reader.add(p)
    reader.finish()
    assert torch.equal(dst[2:5], src) and dst[:2].abs().sum() == 0


def _pieces(tensors, chunk):
    msgs = encode_chunks(ps_pb2.PushHeader(), tensors, chunk)
    return [p for m in msgs for p in ps_pb2.PushChunk.FromString(m).pieces]


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda ps: ps[0].__setattr__("name", "other"), "unknown tensor"),
        (lambda ps: ps[0].__setattr__("dtype", "float64"), "dtype"),
        (lambda ps: ps[0].shape.__setitem__(0, 99), "shape"),
        (lambda ps: ps[1].__setattr__("offset", 5), "piece at byte 5"),
        (lambda ps: ps.pop(1), "moved on|expected byte"),
        (lambda ps: ps.append(ps[0]), "sent twice"),
    ],
)
def test_reader_refuses_inconsistent_streams(mutate, match):
    pieces = _pieces([("w", torch.ones(8, 4)), ("b", torch.ones(8))], 64)
    mutate(pieces)
    expect = {"w": ("float32", [8, 4]), "b": ("float32", [8])}.get
    reader = TensorReader(expect)
    with pytest.raises(WireError, match=match):
        for p in pieces:
            reader.add(p)
        reader.finish()
