"""Tests of examples/ctr_data.py: Criteo TSV reading and writing, slot ids, the planted model."""

import itertools
import sys

import numpy as np
import pytest

from tests.helpers import paths

sys.path.insert(0, str(paths.EXAMPLES))
import ctr_data  # noqa: E402
from ctr_data import (  # noqa: E402
    N_DENSE,
    N_SPARSE,
    CtrData,
    featurize,
    generate,
    generate_raw,
    parse_lines,
    read_criteo_tsv,
    slot_ids,
    write_criteo_tsv,
)
from sklearn.metrics import roc_auc_score  # noqa: E402

MASK64 = (1 << 64) - 1


def splitmix64_ref(slot: int, value: int | None) -> int:
    """Pure-Python reference of slot_ids for one entry (value None = missing)."""
    x = ((slot << 33) | ((1 << 32) if value is None else value)) + 0x9E3779B97F4A7C15 & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    x ^= x >> 31
    return x - (1 << 64) if x >= 1 << 63 else x


def assert_same(a: CtrData, b: CtrData):
    assert a.dense.dtype == b.dense.dtype == np.float32 and a.dense.shape == b.dense.shape
    assert a.ids.dtype == b.ids.dtype == np.int64 and a.ids.shape == b.ids.shape
    assert a.label.dtype == b.label.dtype == np.float32 and a.label.shape == b.label.shape
    np.testing.assert_array_equal(a.dense, b.dense)
    np.testing.assert_array_equal(a.ids, b.ids)
    np.testing.assert_array_equal(a.label, b.label)


# ---------------------------------------------------------------- TSV round trip and parsing


def test_write_read_round_trip(tmp_path):
    raw = generate_raw(3000, seed=1, vocab_size=5000)
    raw_dense, dense_missing, raw_cat, cat_missing, label = raw
    assert dense_missing.any() and cat_missing.any() and (raw_dense < 0).any()
    assert set(np.unique(label)) == {0.0, 1.0}
    path = tmp_path / "train.txt"
    write_criteo_tsv(path, *raw)
    lines = path.read_text().split("\n")
    assert len(lines) == 3001 and lines[-1] == ""
    assert all(len(line.split("\t")) == 40 for line in lines[:-1])
    first = lines[0].split("\t")
    assert first[0] == ("1" if label[0] else "0")
    assert all(len(f) in (0, 8) and f == f.lower() for f in first[14:])
    expected = featurize(*raw)
    assert_same(read_criteo_tsv(path), expected)
    assert_same(read_criteo_tsv(str(path), limit=100), expected.subset(slice(0, 100)))
    assert len(read_criteo_tsv(path, limit=0)) == 0


# label, 13 dense, 26 categorical; empty = missing; upper-case and short hex; negative dense.
HAND_DENSE = [
    ["1", "", "-1", "0", "12", "", "3", "100", "0", "1", "", "7", "123456789012"],
    ["", "", "", "", "", "", "", "", "", "", "", "", ""],
    ["5", "2", "0", "9", "0", "1", "0", "0", "65535", "0", "3", "0", "8"],
]
HAND_CAT = [
    [
        "68fd1e64",
        "ABCDEF01",
        "a",
        "",
        "0",
        "FFFFFFFF",
        "00000000",
        "1",
        "c0ffee",
        "Dead",
        "beef",
        "7",
        "80000000",
        "",
        "1f",
        "2F",
        "3e4",
        "4E5F",
        "5a6b7",
        "6C7D8E",
        "00000001",
        "",
        "fFfF",
        "9",
        "ab",
        "CD",
    ],
    ["", "", "", "", "", "", "", "", "", "", "", "", "", "", "", "", "", "", "", "", "", "", "", "", "", ""],
    ["0"] * 13 + ["ffffffff"] * 13,
]
HAND_LABEL = ["1", "0", "1"]


def test_hand_written_tsv(tmp_path):
    text = "\r\n".join("\t".join([lab] + d + c) for lab, d, c in zip(HAND_LABEL, HAND_DENSE, HAND_CAT))
    path = tmp_path / "hand.tsv"
    path.write_bytes(text.encode())  # CRLF line ends, no final newline
    data = read_criteo_tsv(path)
    assert len(data) == 3
    np.testing.assert_array_equal(data.label, np.array([1, 0, 1], np.float32))

    dense_missing = np.array([[f == "" for f in row] for row in HAND_DENSE])
    raw_dense = np.array([[0 if f == "" else int(f) for f in row] for row in HAND_DENSE], np.int64)
    assert raw_dense[0, 12] == 123456789012 and raw_dense[0, 2] == -1
    expected_dense = np.log1p(np.maximum(raw_dense, 0).astype(np.float32))
    expected_dense[dense_missing] = 0
    np.testing.assert_array_equal(data.dense, expected_dense)
    assert data.dense[0, 2] == 0.0 and data.dense[0, 1] == 0.0  # -1 clipped; missing
    assert data.dense[0, 4] == np.log1p(np.float32(12))

    ids = [
        [splitmix64_ref(s, None if f == "" else int(f, 16)) for s, f in enumerate(row)] for row in HAND_CAT
    ]
    np.testing.assert_array_equal(data.ids, np.array(ids, np.int64))
    # Same value, different spelling: 'ab' / 'AB' / '000000ab' are one id in the same slot.
    assert data.ids[0, 2] == splitmix64_ref(2, 0xA) and data.ids[2, 0] == splitmix64_ref(0, 0)
    assert data.ids[0, 4] == data.ids[2, 4]  # "0" and "0"
    assert data.ids[0, 6] == splitmix64_ref(6, 0) == data.ids[2, 6]  # "00000000" == "0"

    # Same content with '\n' line ends and a final newline parses the same.
    path2 = tmp_path / "hand_lf.tsv"
    path2.write_bytes((text.replace("\r\n", "\n") + "\n").encode())
    assert_same(read_criteo_tsv(path2), data)


def _line(label="0", dense=None, cat=None):
    return "\t".join([label] + (dense or ["1"] * N_DENSE) + (cat or ["0a"] * N_SPARSE))


@pytest.mark.parametrize(
    "bad, message",
    [
        ("\t".join(_line().split("\t")[:-1]), "expected 40 tab-separated fields, got 39"),
        (_line() + "\t", "expected 40 tab-separated fields, got 41"),
        ("", "expected 40 tab-separated fields, got 1"),
        (_line(dense=["1"] * 5 + ["1.5"] + ["1"] * 7), "field 7: dense column is not an integer"),
        (_line(dense=["x"] + ["1"] * 12), "field 2: dense column is not an integer"),
        (_line(dense=["1"] * 12 + ["-"]), "field 14: dense column is not an integer"),
        (_line(dense=["1"] * 12 + ["1" * 19]), "field 14: dense column is not an integer"),
        (_line(cat=["0a"] * 25 + ["xyz"]), "field 40: categorical column is not hex"),
        (_line(cat=["123456789"] + ["0a"] * 25), "field 15: categorical column is not hex"),
        (_line(cat=["-1"] + ["0a"] * 25), "field 15: categorical column is not hex"),
        (_line(cat=["0a"] * 3 + ["ab\u00e9"] + ["0a"] * 22), "field 18: categorical column is not hex"),
        (_line(dense=["1"] * 3 + ["1\x002"] + ["1"] * 9), "field 5: dense column is not an integer"),
        (_line(label="2"), "field 1: label must be 0 or 1"),
        (_line(label=""), "field 1: label must be 0 or 1"),
        (_line(label="01"), "field 1: label must be 0 or 1"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, bad, message):
    path = tmp_path / "bad.tsv"
    path.write_text("\n".join([_line("1"), _line("0"), bad, _line("1")]) + "\n")
    with pytest.raises(ValueError, match=f"bad.tsv: line 3: {message}"):
        read_criteo_tsv(path)
    assert len(read_criteo_tsv(path, limit=2)) == 2  # the lines before it are fine


def test_parse_lines_names_the_given_line_numbers():
    """parse_lines parses whole lines from anywhere in a file: errors carry the numbers it was given."""
    good, bad = _line("1"), _line(dense=["1"] * 12 + ["x"])
    data = parse_lines(("\n".join([good, good]) + "\n").encode(), np.array([7, 9]), "f.tsv")
    assert_same(data, parse_lines((good + "\n").encode() * 2, np.array([1, 2]), "f.tsv"))
    with pytest.raises(ValueError, match="f.tsv: line 12: field 14: dense column is not an integer"):
        parse_lines(("\n".join([good, bad]) + "\n").encode(), np.array([10, 12]), "f.tsv")
    with pytest.raises(ValueError, match="2 lines but 1 line numbers"):
        parse_lines((good + "\n").encode() * 2, np.array([1]), "f.tsv")


def test_first_bad_line_is_reported_across_chunks(tmp_path):
    n = ctr_data._CHUNK_LINES * 2 + 10
    lines = [_line()] * n
    lines[n - 3] = _line(cat=["g"] * N_SPARSE)
    lines[n - 1] = _line(label="x")
    path = tmp_path / "long.tsv"
    path.write_text("\n".join(lines))
    with pytest.raises(ValueError, match=f"line {n - 2}: field 15: categorical"):
        read_criteo_tsv(path)


# ---------------------------------------------------------------- slot ids


def test_slot_ids_match_reference_and_are_stable():
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 1 << 32, (50, N_SPARSE), dtype=np.uint32)
    missing = rng.random((50, N_SPARSE)) < 0.2
    ids = slot_ids(raw, missing)
    assert ids.dtype == np.int64 and ids.shape == (50, N_SPARSE)
    for r, s in itertools.product(range(50), range(N_SPARSE)):
        assert ids[r, s] == splitmix64_ref(s, None if missing[r, s] else int(raw[r, s]))
    np.testing.assert_array_equal(slot_ids(raw.copy(), missing.copy()), ids)
    # Pinned values: ids are persisted by trainers and pservers, so the hash must never change.
    np.testing.assert_array_equal(
        slot_ids(np.array([[0, 0xDEADBEEF, 5]], np.uint32), np.array([[False, False, True]])),
        [[-2152535657050944081, 3564404800396405878, -5318215300934776470]],
    )


def test_slot_ids_separate_slots_values_and_missing():
    n = 100_000
    value = np.arange(n, dtype=np.uint32) * np.uint32(40503)  # distinct values
    raw = np.repeat(value[:, None], N_SPARSE, axis=1)
    ids = slot_ids(raw, np.zeros(raw.shape, bool))
    ordered = np.sort(ids.ravel())  # (np.unique / np.isin are slow on 2.6M spread-out int64)
    assert (np.diff(ordered) != 0).all()  # no collision across values or slots
    missing_ids = slot_ids(np.zeros((1, N_SPARSE), np.uint32), np.ones((1, N_SPARSE), bool))[0]
    assert len(set(missing_ids.tolist())) == N_SPARSE
    pos = np.minimum(np.searchsorted(ordered, missing_ids), len(ordered) - 1)
    assert not (ordered[pos] == missing_ids).any()
    # The raw value under a missing mark is ignored.
    np.testing.assert_array_equal(
        slot_ids(raw[:3], np.ones((3, N_SPARSE), bool)), np.tile(missing_ids, (3, 1))
    )
    # Spread over the whole int64 range.
    assert 0.45 < (ids < 0).mean() < 0.55
    assert ids.min() < -(1 << 62) and ids.max() > 1 << 62


# ---------------------------------------------------------------- CtrData and featurize


def test_featurize_and_ctrdata():
    raw_dense = np.array([[-5, 0, 3] + [1] * 10, [7, 2, 0] + [0] * 10], np.int64)
    dense_missing = np.zeros((2, N_DENSE), bool)
    dense_missing[1, 0] = True
    raw_cat = np.arange(2 * N_SPARSE, dtype=np.uint32).reshape(2, N_SPARSE)
    data = featurize(raw_dense, dense_missing, raw_cat, np.zeros((2, N_SPARSE), bool), np.array([1, 0]))
    assert data.dense.dtype == np.float32 and data.ids.dtype == np.int64 and data.label.dtype == np.float32
    np.testing.assert_array_equal(data.dense[:, :3], np.log1p(np.array([[0, 0, 3], [0, 2, 0]], np.float32)))
    np.testing.assert_array_equal(data.label, [1.0, 0.0])
    big = generate(500, seed=2, vocab_size=1000)
    assert len(big) == 500
    parts = [big.subset(slice(0, 123)), big.subset(np.arange(123, 400)), big.subset(slice(400, None))]
    assert_same(CtrData.concat(parts), big)
    positives = CtrData.concat([big.subset([i]) for i in np.flatnonzero(big.label)])
    assert_same(big.subset(big.label == 1), positives)
    with pytest.raises(ValueError):
        CtrData.concat([])


# ---------------------------------------------------------------- the planted model


def test_generate_is_deterministic_and_sample_seed_changes_examples():
    a = generate(5000, seed=3, vocab_size=20_000)
    assert_same(a, generate(5000, seed=3, vocab_size=20_000))
    assert_same(
        generate(5000, seed=3, vocab_size=20_000, sample_seed=7),
        generate(5000, seed=3, vocab_size=20_000, sample_seed=7),
    )
    b = generate(5000, seed=3, vocab_size=20_000, sample_seed=7)
    assert not np.array_equal(a.ids, b.ids) and not np.array_equal(a.dense, b.dense)
    # A tuple of ints is a sample seed too (ctr_stream draws unit u of stream s with (s, u)).
    c = generate(5000, seed=3, vocab_size=20_000, sample_seed=(0, 7))
    assert_same(c, generate(5000, seed=3, vocab_size=20_000, sample_seed=(0, 7)))
    assert not np.array_equal(c.ids, b.ids) and not np.array_equal(c.ids, a.ids)
    assert a.dense.shape == (5000, N_DENSE) and a.ids.shape == (5000, N_SPARSE)
    raw_dense, dense_missing, raw_cat, cat_missing, label = generate_raw(20_000, seed=3, vocab_size=20_000)
    assert raw_dense.dtype == np.int64 and raw_cat.dtype == np.uint32 and label.dtype == np.float32
    assert 0.05 <= dense_missing.mean() <= 0.10 and 0.02 <= cat_missing.mean() <= 0.05
    assert (raw_dense[dense_missing] == 0).all() and (raw_cat[cat_missing] == 0).all()
    assert (raw_dense >= -1).all() and (raw_dense == 0).mean() > 0.1 and raw_dense.max() > 1000


def test_sample_seeds_share_the_planted_model():
    a = generate_raw(20_000, seed=4, sample_seed=1)
    b = generate_raw(20_000, seed=4, sample_seed=2)
    ids_a, ids_b = featurize(*a).ids, featurize(*b).ids
    # Heavy-headed value distributions: most occurrences in b are of values seen in a.
    assert np.isin(ids_b, ids_a).mean() > 0.8
    assert 0.15 <= a[4].mean() <= 0.35 and 0.15 <= b[4].mean() <= 0.35
    # Another seed is another model: other raw values, so other ids (but for "missing", whose
    # id depends on the slot only).
    c = generate_raw(20_000, seed=5, sample_seed=1)
    assert np.isin(featurize(*c).ids[~c[3]], ids_a).mean() < 0.001
    assert np.isin(featurize(*c).ids[c[3]], ids_a).all()


def _one_hot_design(data: CtrData, vocab: np.ndarray) -> np.ndarray:
    col = np.searchsorted(vocab, data.ids)
    assert (vocab[np.minimum(col, len(vocab) - 1)] == data.ids).all()
    x = np.zeros((len(data), len(vocab) + N_DENSE))
    np.put_along_axis(x, col, 1.0, axis=1)
    x[:, len(vocab) :] = data.dense
    return x


def test_true_logits_are_linear_in_the_features_and_shared_across_samples():
    # The logit is bias + one weight per (slot, value) + a linear function of the dense
    # features: least squares on one-hot ids + dense fits it exactly on one sample, and the same
    # coefficients give the logits of a sample drawn with another sample seed (same model).
    fit = generate_raw(3000, seed=6, vocab_size=10, sample_seed=1, return_logits=True)
    other = generate_raw(3000, seed=6, vocab_size=10, sample_seed=2, return_logits=True)
    fit_data, other_data = featurize(*fit[:5]), featurize(*other[:5])
    vocab = np.unique(fit_data.ids)
    assert np.isin(other_data.ids, vocab).all()
    x = _one_hot_design(fit_data, vocab)
    coef, *_ = np.linalg.lstsq(x, fit[5], rcond=None)
    assert np.abs(x @ coef - fit[5]).max() < 1e-4
    assert np.abs(_one_hot_design(other_data, vocab) @ coef - other[5]).max() < 1e-4
    # The dense part of the logit is not negligible.
    assert np.abs(x[:, len(vocab) :] @ coef[len(vocab) :]).std() > 0.1


@pytest.mark.parametrize("seed", [0, 11])
def test_bayes_auc_and_positive_rate_in_design_range(seed):
    *_, label, logit = generate_raw(100_000, seed=seed, sample_seed=12345, return_logits=True)
    assert 0.22 <= label.mean() <= 0.28
    assert 0.78 <= roc_auc_score(label, logit) <= 0.82
    assert 1.2 < logit.std() < 1.6
    assert ctr_data.bayes_auc(100_000, seed=seed, sample_seed=12345) == roc_auc_score(label, logit)
