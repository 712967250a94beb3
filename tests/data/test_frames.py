"""The data channel's frames and payload layouts (psproto.dataplane): the bytes both sides share."""

import numpy as np
import pytest

from psproto.dataplane import frames, payload
from psproto.dataplane.frames import AnswerHeader, ConnectionHello, FrameError, RegionAddress, RequestHeader


def test_a_connection_hello_round_trips():
    hello = ConnectionHello(7, 1, 2, "tok", "session-x", "digest")
    data = hello.pack()
    head = data[: ConnectionHello.head_size()]
    rest = data[ConnectionHello.head_size() :]
    assert ConnectionHello.rest_size(head) == len(rest)
    assert ConnectionHello.unpack(head, rest) == hello


def test_a_connection_hello_of_text_beyond_ascii_round_trips():
    """The lengths count bytes: a part of several-byte characters does not shift the parts after it."""
    hello = ConnectionHello(0, 1, 1, "tök€n", "sessiön", "digest")
    data = hello.pack()
    head = data[: ConnectionHello.head_size()]
    assert ConnectionHello.unpack(head, data[ConnectionHello.head_size() :]) == hello


def test_a_connection_hello_whose_part_ends_inside_a_character_is_refused():
    # "é" is 2 bytes: a token of 1 byte ends inside it, although the whole text is UTF-8.
    data = ConnectionHello(0, 0, 1, "é", "s", "d").pack()
    head = bytearray(data[: ConnectionHello.head_size()])
    head[16:20] = (1).to_bytes(2, "little") + (2).to_bytes(2, "little")
    with pytest.raises(FrameError, match="not UTF-8"):
        ConnectionHello.unpack(bytes(head), data[ConnectionHello.head_size() :])


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: b"XXXX" + d[4:], "bad magic"),
        (lambda d: d[:4] + (2).to_bytes(2, "little") + d[6:], "version 2"),
        (lambda d: d[:14] + (0).to_bytes(2, "little") + d[16:], "slot 0 of 0 lanes"),
    ],
)
def test_a_bad_connection_hello_is_refused(mutate, match):
    data = mutate(ConnectionHello(0, 0, 1, "", "s", "d").pack())
    with pytest.raises(FrameError, match=match):
        ConnectionHello.rest_size(data[: ConnectionHello.head_size()])


def test_a_request_header_round_trips_in_64_bytes():
    header = RequestHeader(frames.PUSH_PULL, frames.SHARED, 4, 2, 1, 3, 10, 11, 2, 5, 9, 1 << 20)
    data = header.pack()
    assert len(data) == RequestHeader.SIZE == 64
    assert RequestHeader.unpack(data, 1 << 21) == header


@pytest.mark.parametrize(
    "header, match",
    [
        (RequestHeader(99), "unknown request kind"),
        (RequestHeader(frames.PULL, flags=0x80), "unknown request flags"),
        (RequestHeader(frames.PULL, lanes=2, lane=2), "lane 2 of 2"),
        (RequestHeader(frames.PULL, lanes=frames.MAX_LANES + 1), f"lane 0 of {frames.MAX_LANES + 1}"),
        (RequestHeader(frames.PULL, step_trainers=frames.MAX_STEP_TRAINERS + 1), "step trainers"),
        (RequestHeader(frames.PUSH_PULL, payload_bytes=1001), "takes 1000"),
    ],
)
def test_a_bad_request_header_is_refused_before_anything_is_allocated(header, match):
    with pytest.raises(FrameError, match=match):
        RequestHeader.unpack(header.pack(), 1000)


def test_a_refusal_carries_its_status_and_message():
    data = frames.refusal(9, "pserver x: plan mismatch")
    header = AnswerHeader.unpack(data[: AnswerHeader.SIZE])
    assert (header.status, header.payload_bytes) == (9, 0)
    assert data[AnswerHeader.SIZE :].decode() == "pserver x: plan mismatch"


def test_a_region_pair_round_trips_and_junk_is_refused():
    pair = (RegionAddress(12, 5, 1 << 20, "psregion-a"), RegionAddress(12, 6, 2 << 20, "psregion-b"))
    assert frames.unpack_regions(frames.pack_regions(*pair)) == pair
    with pytest.raises(FrameError):
        frames.unpack_regions(frames.pack_regions(*pair) + b"x")
    with pytest.raises(FrameError):
        frames.unpack_regions(b"\x01\x02")


def test_dense_layout_aligns_every_block_and_narrows_to_the_wire_dtype():
    blocks = [("a", 3, "float32"), ("b", 16, "float32"), ("c", 1, "float64")]
    own = payload.DenseLayout.of(blocks)
    assert own.offsets == (0, 64, 128) and own.nbytes == 192
    narrow = payload.DenseLayout.of(blocks, "bfloat16")
    assert narrow.offsets == (0, 64, 128) and narrow.dtypes == ("bfloat16",) * 3
    assert own.uniform_dtype() == "" and payload.DenseLayout.of(blocks[:2]).uniform_dtype() == "float32"


def test_a_push_layout_places_presence_dense_counts_and_tables():
    dense = payload.DenseLayout.of([("a", 20, "float32")])
    tables = [payload.TableShape(4, "float32"), payload.TableShape(2, "float64")]
    counts = payload.TableCounts((3, 0), (5, 2), (True, False))
    layout = payload.PushLayout.of(dense, True, tables, counts)
    assert layout.presence == (0, 1) and layout.dense == (64, 128)
    assert layout.counts == (192, 64)  # two tables' three uint64 each, padded
    (ids0, rows0, next0), (ids1, rows1, next1) = layout.tables
    assert ids0 == (256, 24) and rows0 == (320, 48) and next0 == (384, 40)
    assert ids1 == (448, 0) and rows1 == (448, 0) and next1 == (448, 16)
    assert layout.nbytes == 512
    assert all(part[0] % payload.ALIGN == 0 for t in layout.tables for part in t)


def test_table_counts_round_trip_through_their_bytes():
    counts = payload.TableCounts((3, 0, 7), (5, 2, 0), (True, True, False))
    data = counts.pack().view(np.uint8)
    assert data.size == counts.nbytes() == 128
    assert payload.TableCounts.unpack(data, 3) == counts
    with pytest.raises(payload.PayloadError):
        payload.TableCounts.unpack(data[:8], 3)
