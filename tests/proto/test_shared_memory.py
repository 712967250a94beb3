"""Same-host payloads through shared memory (psproto.shared, PushPullShared).

The regions and their refusals, the codec writing into and reading from one,
the trainer's pool of regions, and whole training runs: through shared memory
the model equals the one trained over gRPC bytes and the single process; a
pserver that cannot map a trainer's regions refuses before anything counts,
and the trainer goes on over gRPC with the same result.
"""

import logging
import os
import tempfile

import grpc
import pytest
import torch

from harness.cluster import LocalCluster
from harness.models import FLOAT64_EXACT, batches, odd_mlp, train_concatenated, train_distributed
from psproto import ps_pb2
from psproto.codec import TensorReader, decode_chunk, encode_chunks, encode_into
from psproto.shared_memory import NAME_PREFIX, Region, SharedMemoryError, map_region
from trainer.transport.shared_regions import RegionPool, region_size
from transpiler import DistributeTranspilerConfig, Program

# -- regions ------------------------------------------------------------------


def test_a_region_mapped_by_its_address_shares_its_bytes_both_ways():
    region = Region(1 << 16)
    try:
        other = map_region(os.getpid(), region.fd, region.name, region.size)
        region.view[:5] = b"hello"
        assert bytes(other[:5]) == b"hello"
        other[5:10] = b"world"
        assert bytes(region.view[:10]) == b"helloworld"
        assert region.name.startswith(NAME_PREFIX)
        assert (
            os.readlink(f"/proc/self/fd/{region.fd}") == f"/memfd:{region.name} (deleted)"
        )  # no path to leak
    finally:
        region.close()


def _refusals():
    region = Region(1 << 16)
    with tempfile.TemporaryFile() as plain:
        os.ftruncate(plain.fileno(), 1 << 16)
        pid = os.getpid()
        yield {
            "another prefix": (
                (pid, region.fd, "other-" + region.name[len(NAME_PREFIX) :], region.size),
                "not a shared region",
            ),
            "another region's name": (
                (pid, region.fd, NAME_PREFIX + "0" * 16, region.size),
                "is not the region",
            ),
            "a plain file": ((pid, plain.fileno(), region.name, region.size), "is not the region"),
            "bigger than the region": (
                (pid, region.fd, region.name, 1 << 17),
                "holds 65536 bytes, not 131072",
            ),
            "no such process": ((2**22 + 7, 3, region.name, region.size), "cannot open"),
            "no such fd": ((pid, 100_000, region.name, region.size), "cannot open"),
            "size zero": ((pid, region.fd, region.name, 0), "not a shared region"),
        }
    region.close()


def test_map_region_refuses_what_is_not_the_named_region_saying_why():
    cases = _refusals()
    table = next(cases)
    try:
        for case, (address, words) in table.items():
            with pytest.raises(SharedMemoryError, match=words):
                map_region(*address)
    finally:
        next(cases, None)


# -- the codec into and out of a region ---------------------------------------

TENSORS = [
    ("w.block0", torch.arange(12, dtype=torch.float32).reshape(3, 4)),
    ("emb@ids", torch.tensor([5, 1, 9], dtype=torch.int64)),
    ("empty", torch.zeros(0, 4)),
]


def test_encode_into_writes_exactly_the_one_message_encode_chunks_sends():
    header = ps_pb2.PushHeader(trainer_id=1, step=7, layout_digest="d", session="s")
    (message,) = encode_chunks(header, TENSORS, 1 << 30)
    buf = memoryview(bytearray(len(message) + 10))
    assert encode_into(buf, header, TENSORS) == len(message)
    assert bytes(buf[: len(message)]) == message


def test_encode_into_a_region_too_small_writes_nothing():
    header = ps_pb2.PushHeader(trainer_id=1, step=7)
    (message,) = encode_chunks(header, TENSORS, 1 << 30)
    buf = memoryview(bytearray(b"\xaa" * (len(message) - 1)))
    assert encode_into(buf, header, TENSORS) == -1
    assert bytes(buf) == b"\xaa" * (len(message) - 1)


def test_a_message_decoded_in_a_region_is_read_in_place_and_rebuilds_the_tensors():
    region = Region(1 << 16)
    try:
        header = ps_pb2.PullHeader(step=3, counted=True)
        n = encode_into(region.view, header, TENSORS)
        got, pieces = decode_chunk(region.view[:n], ps_pb2.PullHeader)
        assert got == header
        assert all(p.data.obj is region.view.obj for p in pieces)  # views of the region, not copies
        shapes = {
            name: ("float32" if t.is_floating_point() else "int64", [-1, *t.shape[1:]]) for name, t in TENSORS
        }
        reader = TensorReader(shapes.get)
        for piece in pieces:
            reader.add(piece)
        rebuilt = reader.finish()
        del pieces
        for name, t in TENSORS:
            assert torch.equal(rebuilt[name], t)
    finally:
        region.close()


# -- the trainer's pool -------------------------------------------------------


def test_region_sizes_add_a_quarter_in_whole_mib():
    assert [region_size(n) for n in (0, 1000, 800_000, 1 << 20, 19_000_000)] == [
        1 << 20,
        1 << 20,
        1 << 20,
        2 << 20,
        23 << 20,
    ]


def test_the_pool_reuses_a_pair_after_a_call_that_ended_and_never_one_whose_call_failed():
    pool = RegionPool()
    try:
        pair = pool.take("a:1", 1000, 2000)
        pool.give_back("a:1", pair, reusable=True)
        again = pool.take("a:1", 1000, 2000)
        assert again is pair
        pool.give_back("a:1", again, reusable=False)  # failed: may still be written into by the pserver
        with pytest.raises(ValueError):
            bytes(pair.request.view[:1])  # closed here
        fresh = pool.take("a:1", 1000, 2000)
        assert fresh.request.name != pair.request.name
        pool.give_back("a:1", fresh, reusable=True)
        bigger = pool.take("a:1", 3 << 20, 10)  # a bigger push: the pair grows
        assert bigger.request.size == region_size(3 << 20) and bigger.answer.size == fresh.answer.size
        assert pool.take("b:2", 10, 10) is not bigger  # pairs are per pserver
    finally:
        pool.close()


# -- training through shared memory --------------------------------------------

STEPS, PER_TRAINER, N_TRAINERS = 3, 8, 2


def _program():
    return Program(odd_mlp(dtype=torch.float64), "adam", lr=0.01)


def _shared_pushes(cluster):
    return [s.servicer.counters.shared_pushes for s in cluster.servers]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("data_channel", [True, False], ids=["data channel", "gRPC"])
def test_sync_training_through_shared_memory_equals_grpc_bytes_and_one_process(data_channel):
    """Over the data channel's regions (bytes inline without) and over gRPC's (gRPC bytes without)."""
    data = batches(N_TRAINERS, PER_TRAINER, STEPS, dtype=torch.float64)
    expected = train_concatenated(_program(), data)
    results = {}
    for shared in (True, False):
        config = DistributeTranspilerConfig(shared_memory=shared, data_channel=data_channel)
        with LocalCluster(_program, 2, N_TRAINERS, config=config) as cluster:
            results[shared] = train_distributed(cluster, data)
            # every step of every trainer at each pserver, or none
            assert _shared_pushes(cluster) == ([STEPS * N_TRAINERS] * 2 if shared else [0, 0])
    for shared, states in results.items():
        for state in states.values():
            for name, value in expected.items():
                torch.testing.assert_close(state[name], value, **FLOAT64_EXACT, msg=lambda m: f"{name}: {m}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("data_channel", [True, False], ids=["data channel", "gRPC"])
def test_a_pserver_that_cannot_map_the_regions_refuses_before_counting_and_the_trainer_goes_on_over_grpc(
    monkeypatch, caplog, data_channel
):
    """The bytes go inline on the data channel, through gRPC without it; nothing refused is counted."""
    import pserver.data.calls
    import pserver.rpc.mapped_regions

    caplog.set_level(logging.INFO, logger="trainer.transport")

    def cannot_map(*address):
        raise SharedMemoryError(
            "cannot open /proc/1/fd/3 (No such file or directory): a trainer on another host"
        )

    monkeypatch.setattr(pserver.rpc.mapped_regions, "map_region", cannot_map)
    monkeypatch.setattr(pserver.data.calls, "map_region", cannot_map)
    data = batches(N_TRAINERS, PER_TRAINER, STEPS, dtype=torch.float64)
    expected = train_concatenated(_program(), data)
    config = DistributeTranspilerConfig(data_channel=data_channel)
    with LocalCluster(_program, 2, N_TRAINERS, config=config) as cluster:
        states = train_distributed(cluster, data)
        assert _shared_pushes(cluster) == [0, 0]
        assert [s.engine.step for s in cluster.servers] == [STEPS, STEPS]  # no refused push counted
        # one refusal per trainer and pserver: the first push; every later one goes over gRPC at once
        assert [s.servicer.counters.refused for s in cluster.servers] == [N_TRAINERS, N_TRAINERS]
    for state in states.values():
        for name, value in expected.items():
            torch.testing.assert_close(state[name], value, **FLOAT64_EXACT, msg=lambda m: f"{name}: {m}")
    assert "cannot map this process's shared memory" in caplog.text


@pytest.mark.timeout(60)
def test_a_hand_made_shared_push_naming_no_region_is_refused_unimplemented_and_changes_nothing():
    with LocalCluster(_program, 1, 1) as cluster, tempfile.TemporaryFile() as plain:
        server = cluster.servers[0]
        os.ftruncate(plain.fileno(), 1 << 20)
        bogus = ps_pb2.SharedRegion(
            pid=os.getpid(), fd=plain.fileno(), name=NAME_PREFIX + "f" * 16, size=1 << 20
        )
        push = ps_pb2.SharedPush(request=bogus, request_bytes=10, answer=bogus)
        with grpc.insecure_channel(cluster.endpoints[0]) as channel:
            call = channel.unary_unary("/psproto.ParameterServer/PushPullShared")
            with pytest.raises(grpc.RpcError) as refused:
                call(push.SerializeToString(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "is not the region" in refused.value.details()
        assert server.engine.step == 0 and server.servicer.counters.pushes == 0


@pytest.mark.timeout(60)
def test_a_shared_push_claiming_more_bytes_than_its_region_is_refused_invalid_argument():
    with LocalCluster(_program, 1, 1) as cluster:
        region = Region(1 << 20)
        try:
            address = region.address(ps_pb2.SharedRegion)
            push = ps_pb2.SharedPush(request=address, request_bytes=(1 << 20) + 1, answer=address)
            with grpc.insecure_channel(cluster.endpoints[0]) as channel:
                call = channel.unary_unary("/psproto.ParameterServer/PushPullShared")
                with pytest.raises(grpc.RpcError) as refused:
                    call(push.SerializeToString(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "in a region of 1048576" in refused.value.details()
            assert cluster.servers[0].engine.step == 0
        finally:
            region.close()
