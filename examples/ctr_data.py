"""CTR data in the Criteo layout: a synthetic generator, a TSV reader/writer and featurisation.

Format. One example per line, 40 tab-separated fields: the label (``0`` or ``1``), 13 integer
("dense") columns in decimal, and 26 categorical columns as 32-bit values in hexadecimal (the
writer uses 8 lower-case digits; the reader also takes upper case and fewer digits). A missing
value is an empty field. Lines end in ``\\n`` or ``\\r\\n``.

Features. ``featurize`` turns raw values into a :class:`CtrData`: dense = ``log1p(max(x, 0))``
(0 if missing); each categorical value becomes one int64 id per slot from :func:`slot_ids`, a
splitmix64 hash of (slot, value) that is a bijection, so distinct (slot, value) pairs never share
an id and a missing value has its own id in each slot. Ids cover the whole int64 range.

Planted model (``generate``/``generate_raw``), fixed by ``seed`` and ``vocab_size`` alone:

- slot ``s`` has ``V_s`` values, ``V_s`` log-spaced from 10 to ``vocab_size`` (shuffled over
  slots), drawn from a bounded power law ``p(k) ~ (k + 1) ** -a_s``, ``a_s ~ U(1.05, 1.35)``, so a
  few values are frequent and most are rare; 2-5% are missing. Value ``k`` is written as the
  uint32 ``fmix32(k + salt_s)`` (a bijection), so the file looks like Criteo's hashed hex;
- each (slot, value), and "missing" in each slot, has a weight drawn from ``N(0, 1)``, then
  centred and scaled so that the slot's term has standard deviation ``sigma_s`` over examples:
  0.42 in 6 strong slots, 0.22 in 10 medium ones, 0.02 in 10 noise slots;
- dense column ``j`` is a geometric count with a log-normal mean ``exp(mu_j + sd_j * z)``
  (``mu_j ~ U(0, 4)``, ``sd_j ~ U(0.5, 1.5)``), 5-10% missing; column 1 is -1 in 2% of rows, like
  Criteo's I2. Weights on the featurised values give the 13 terms a joint standard deviation 0.6;
- ``label ~ Bernoulli(sigmoid(bias + sum of the terms))``, the bias fitted to 25% positives.

The logit (standard deviation 1.38) is linear in the one-hot ids and the dense features, so
logistic regression can learn it; the Bayes AUC (of the true logits) is 0.80 for every seed
(:func:`bayes_auc`), and logistic regression trained on 200k examples reaches about 0.77.

Streaming (each trainer reading only its shard, in batches) is in ``ctr_stream.py``.
"""

from __future__ import annotations

import functools
import itertools
from collections import namedtuple
from dataclasses import dataclass

import numpy as np

N_DENSE = 13
N_SPARSE = 26
N_FIELDS = 1 + N_DENSE + N_SPARSE

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MISSING_MARK = np.uint64(1 << 32)  # outside uint32, so no real value can hash to "missing"
_SLOT_SHIFT = np.uint64(33)  # (slot << 33) | value is injective for value <= 2**32
_MASK32 = np.uint64(0xFFFFFFFF)
_CHUNK_LINES = 1 << 12  # bounds the reader's and writer's memory per pass
_MAX_DIGITS = 18  # decimal digits that always fit in int64
_PAD = 32  # bytes after the data, so every field's 8-byte words fit


@dataclass
class CtrData:
    """Featurized examples, ready for a model: dense float32 (n, 13), ids int64 (n, 26), label
    float32 (n,) of 0.0 / 1.0."""

    dense: np.ndarray
    ids: np.ndarray
    label: np.ndarray

    def __post_init__(self):
        if not len(self.dense) == len(self.ids) == len(self.label):
            raise ValueError(f"row counts differ: {len(self.dense)}, {len(self.ids)}, {len(self.label)}")

    def __len__(self) -> int:
        """The number of examples."""
        return len(self.label)

    def subset(self, index) -> "CtrData":
        """The rows selected by ``index`` (a slice, an integer array or a boolean mask)."""
        return CtrData(self.dense[index], self.ids[index], self.label[index])

    @staticmethod
    def concat(parts: list["CtrData"]) -> "CtrData":
        """All rows of ``parts``, in order; raises ValueError on an empty list."""
        if not parts:
            raise ValueError("CtrData.concat needs at least one part")
        return CtrData(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("dense", "ids", "label")))


def _mix64(x: np.ndarray) -> np.ndarray:
    # splitmix64's finaliser: a bijection on uint64 (xor-shifts and odd multipliers), so it
    # cannot create collisions. numpy's uint64 array arithmetic wraps modulo 2**64, as intended.
    # In place (x is a fresh array) to halve the memory traffic on large batches.
    tmp = np.empty_like(x)
    for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB), (31, None)):
        x ^= np.right_shift(x, np.uint64(shift), out=tmp)
        if mult is not None:
            x *= np.uint64(mult)
    return x


def _fmix32(x: np.ndarray) -> np.ndarray:
    # murmur3's 32-bit finaliser, a bijection on uint32, so distinct values stay distinct.
    x = x & _MASK32
    for shift, mult in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        x = ((x ^ (x >> np.uint64(shift))) * np.uint64(mult)) & _MASK32
    return x ^ (x >> np.uint64(16))


def slot_ids(raw_cat: np.ndarray, missing: np.ndarray) -> np.ndarray:
    """int64 (n, slots) ids of raw categorical values (uint32 (n, slots)) and their missing mask.

    The id is splitmix64 of ``(slot << 33) | value`` (value := 2**32 when missing), viewed as
    int64. Both steps are injective, so ids never collide across slots or values, a missing value
    gets its own id per slot, and the ids are spread over the whole int64 range. Pure: the same
    inputs give the same ids in every process and on every platform."""
    key = np.asarray(raw_cat).astype(np.uint64)
    key &= _MASK32
    np.copyto(key, _MISSING_MARK, where=np.asarray(missing, bool))
    key |= np.arange(key.shape[-1], dtype=np.uint64) << _SLOT_SHIFT
    key += _GOLDEN
    return _mix64(key).view(np.int64)


def _dense_features(raw_dense: np.ndarray, dense_missing: np.ndarray) -> np.ndarray:
    dense = np.log1p(np.clip(raw_dense, 0, None).astype(np.float32))
    dense[dense_missing] = 0.0
    return dense


def featurize(
    raw_dense: np.ndarray,
    dense_missing: np.ndarray,
    raw_cat: np.ndarray,
    cat_missing: np.ndarray,
    label: np.ndarray,
) -> CtrData:
    """Featurize raw values: dense = ``log1p(max(x, 0))`` as float32 with missing -> 0, ids from
    :func:`slot_ids`, label as float32. ``raw_dense`` is int64 (n, 13) (negative values occur in
    real Criteo data and are clipped), ``raw_cat`` uint32 (n, 26); masks are bool of the same shapes."""
    return CtrData(
        _dense_features(raw_dense, dense_missing),
        slot_ids(raw_cat, cat_missing),
        np.asarray(label, np.float32),
    )


# Per slot (26,): vocab size, zipf exponent, cat_missing rate, salt; cat_w holds slot s's
# vocab[s] + 1 weights (the last for "missing") from offset[s]. Per dense column (13,): mu and sd
# of the log-mean, missing rate, weight.
_Model = namedtuple("_Model", "vocab offset zipf cat_missing salt cat_w mu sd dense_missing dense_w bias")
_SLOT_SIGMA = np.array([0.42] * 6 + [0.22] * 10 + [0.02] * 10)
_DENSE_SIGMA = 0.6
_POSITIVE_RATE = 0.25


def _sample(m, n: int, rng: np.random.Generator):
    """Raw features of ``n`` examples from model ``m``, and their logits without the bias."""
    # Geometric counts with a log-normal mean (floor(E / log1p(1/mean)), E ~ Exp(1)): heavy-tailed,
    # many zeros, like Criteo's counters, and much cheaper to draw than Poisson.
    mean = np.exp(m.mu + m.sd * rng.standard_normal((n, N_DENSE)))
    raw_dense = np.floor(rng.standard_exponential((n, N_DENSE)) / np.log1p(1.0 / mean)).astype(np.int64)
    raw_dense[rng.random(n) < 0.02, 1] = -1
    dense_missing = rng.random((n, N_DENSE)) < m.dense_missing
    raw_dense[dense_missing] = 0
    logit = _dense_features(raw_dense, dense_missing).astype(np.float64) @ m.dense_w
    # Slot-major while drawing (contiguous rows), transposed once at the end.
    raw_cat = np.empty((N_SPARSE, n), np.uint32)
    cat_missing = np.empty((N_SPARSE, n), bool)
    for s in range(N_SPARSE):
        v, a, r = m.vocab[s], m.zipf[s], m.cat_missing[s]
        u = rng.random(n)
        miss = np.less(u, r, out=cat_missing[s])
        # Rescaled u through the inverse CDF of the density x**-a on [1, V+1): a continuous Zipf.
        x = (1.0 + (u - r) / (1.0 - r) * ((v + 1.0) ** (1.0 - a) - 1.0)) ** (1.0 / (1.0 - a))
        k = np.minimum(x.astype(np.int64) - 1, v - 1)
        k[miss] = v
        logit += m.cat_w[m.offset[s] + k]
        raw_cat[s] = _fmix32(k.astype(np.uint64) + m.salt[s])
        raw_cat[s, miss] = 0
    return raw_dense, dense_missing, raw_cat.T.copy(), cat_missing.T.copy(), logit


@functools.lru_cache(maxsize=4)
def _planted_model(seed: int, vocab_size: int):
    """The ground truth for (seed, vocab_size).

    Weights are drawn from normals, then each slot's are centred and scaled so that the slot's
    logit term has exactly variance sigma_s**2 under its value distribution (and the dense terms
    together variance _DENSE_SIGMA**2): otherwise a few head values' draws would swing the
    Bayes AUC by several points between seeds. The bias is then fitted to a 25% positive rate."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    rng = np.random.default_rng([seed, vocab_size, 0x6D6F64])
    vocab = rng.permutation(np.geomspace(min(10, vocab_size), vocab_size, N_SPARSE).round().astype(np.int64))
    sigma = rng.permutation(_SLOT_SIGMA)
    zipf, cat_missing = rng.uniform(1.05, 1.35, N_SPARSE), rng.uniform(0.02, 0.05, N_SPARSE)
    cat_w = []
    for s in range(N_SPARSE):
        v, a, r = vocab[s], zipf[s], cat_missing[s]
        cdf = (np.arange(1.0, v + 2.0) ** (1.0 - a) - 1.0) / ((v + 1.0) ** (1.0 - a) - 1.0)
        p = np.append(np.diff(cdf) * (1.0 - r), r)  # as _sample draws: values 0..v-1, then missing
        w = rng.standard_normal(v + 1)
        w -= p @ w
        cat_w.append(w * (sigma[s] / np.sqrt(p @ w**2)))
    m = _Model(
        vocab=vocab,
        offset=np.concatenate([[0], np.cumsum(vocab + 1)]),
        zipf=zipf,
        cat_missing=cat_missing,
        salt=rng.integers(0, 1 << 32, N_SPARSE, dtype=np.uint64),
        cat_w=np.concatenate(cat_w),
        mu=rng.uniform(0.0, 4.0, N_DENSE),
        sd=rng.uniform(0.5, 1.5, N_DENSE),
        dense_missing=rng.uniform(0.05, 0.10, N_DENSE),
        dense_w=np.zeros(N_DENSE),
        bias=0.0,
    )
    calibration = np.random.default_rng([seed, vocab_size, 0x626961])
    raw_dense, dense_missing, *_, logit = _sample(m, 50_000, calibration)
    dense = _dense_features(raw_dense, dense_missing).astype(np.float64)
    z = rng.standard_normal(N_DENSE)
    dense_w = z / np.sqrt(z @ z) * _DENSE_SIGMA / dense.std(0)  # columns are independent: variances add
    logit += (dense - dense.mean(0)) @ dense_w
    lo, hi = -20.0, 20.0
    for _ in range(60):  # bisection: the mean of sigmoid(b + logit) increases with b
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if np.mean(1.0 / (1.0 + np.exp(-(mid + logit)))) < _POSITIVE_RATE else (lo, mid)
    return m._replace(dense_w=dense_w, bias=0.5 * (lo + hi) - dense.mean(0) @ dense_w)


def generate_raw(
    n: int, seed: int = 0, vocab_size: int = 100_000, sample_seed=None, return_logits: bool = False
) -> tuple:
    """Raw values of ``n`` examples of the planted model for (seed, vocab_size), as
    ``(raw_dense int64 (n,13), dense_missing, raw_cat uint32 (n,26), cat_missing, label float32)``,
    plus the true logits (float64 (n,)) if ``return_logits``. The examples are drawn with
    ``sample_seed`` (an int or a tuple of ints; default: ``seed`` itself), so a different sample
    seed gives a held-out set from the same model. Missing entries hold 0 in the raw arrays."""
    m = _planted_model(int(seed), int(vocab_size))
    sample = [int(seed)] if sample_seed is None else [int(x) for x in np.atleast_1d(sample_seed)]
    rng = np.random.default_rng([*sample, int(seed), 0x73616D])
    raw_dense, dense_missing, raw_cat, cat_missing, logit = _sample(m, int(n), rng)
    logit += m.bias
    label = (rng.random(int(n)) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    out = (raw_dense, dense_missing, raw_cat, cat_missing, label)
    return out + (logit,) if return_logits else out


def generate(n: int, seed: int = 0, vocab_size: int = 100_000, *, sample_seed=None) -> CtrData:
    """``n`` featurized examples of the planted model (see the module docstring); the model
    depends only on (seed, vocab_size), the examples also on ``sample_seed``."""
    return featurize(*generate_raw(n, seed, vocab_size, sample_seed))


def bayes_auc(n: int = 200_000, seed: int = 0, vocab_size: int = 100_000, sample_seed=None) -> float:
    """AUC of the true logits on ``n`` fresh examples: the best AUC any model can expect."""
    from sklearn.metrics import roc_auc_score  # here: readers and DataLoader workers never need it

    *_, label, logit = generate_raw(n, seed, vocab_size, sample_seed, return_logits=True)
    return float(roc_auc_score(label, logit))


def write_criteo_tsv(path, raw_dense, dense_missing, raw_cat, cat_missing, label) -> None:
    """Write examples in Criteo format: label, 13 decimal integers, 26 categorical values as
    8-digit lower-case hex, tab-separated, one example per line ending in ``\\n``; a missing value
    is an empty field."""
    n = len(label)
    hex_digits = np.frombuffer(b"0123456789abcdef", np.uint8)
    shifts = np.arange(28, -1, -4, dtype=np.uint64)  # 8 nibbles, most significant first
    with open(path, "w", encoding="ascii", newline="\n") as f:
        for a in range(0, n, _CHUNK_LINES):
            b = min(n, a + _CHUNK_LINES)
            cols = [np.asarray(label[a:b]).astype(np.int64).astype(str)]
            dense = np.asarray(raw_dense[a:b], np.int64).astype(str)
            dense[np.asarray(dense_missing[a:b], bool)] = ""
            nibbles = (np.asarray(raw_cat[a:b], np.uint64)[..., None] >> shifts) & np.uint64(0xF)
            cat = hex_digits[nibbles.astype(np.intp)].view("S8")[..., 0].astype(str)
            cat[np.asarray(cat_missing[a:b], bool)] = ""
            cols += [dense[:, j] for j in range(N_DENSE)] + [cat[:, j] for j in range(N_SPARSE)]
            # zip/join run in C: no per-example Python bytecode.
            f.write("\n".join(map("\t".join, zip(*(c.tolist() for c in cols)))) + "\n")


_L = np.uint64(0x0101010101010101)  # SWAR: a uint64 word holds 8 bytes of a field, first in the low byte
_H = np.uint64(0x8080808080808080)
_BYTE_MASK = np.array([(1 << 8 * k) - 1 for k in range(9)], np.uint64)
_POW = {base: np.uint64(base) ** np.arange(9, dtype=np.uint64) for base in (10, 16)}


def _at_least(v: np.ndarray, n: int) -> np.ndarray:
    # High bit of each byte set iff that byte >= n; exact for bytes < 0x80, as the high bit
    # stops a byte's borrow from reaching the next one.
    return ((v | _H) - _L * np.uint64(n)) & _H


def _parse_words(x: np.ndarray, ln: np.ndarray, base: int):
    """Values of up to 8 digits (decimal, or hex in either case), one field per uint64 word ``x``
    whose first ``ln`` bytes are the digits; and a mask of words with a non-digit among them.
    A dozen word operations instead of a dozen passes per character."""
    active = _BYTE_MASK[ln]
    y = x & ~_H
    ok = _at_least(y, 0x30) & ~_at_least(y, 0x3A)
    digit = y & (_L * np.uint64(0x0F))
    if base == 16:
        lower = y | (_L * np.uint64(0x20))  # A-F -> a-f
        letter = _at_least(lower, 0x61) & ~_at_least(lower, 0x67)
        ok |= letter
        digit += (letter >> np.uint64(7)) * np.uint64(9)  # 'a' & 0x0F == 1, worth 10
    bad = ((~ok | x) & _H & active) != 0
    digit &= active
    # Combine neighbours, first digit most significant: 8 bytes -> 4 x 16 -> 2 x 32 -> 64 bits,
    # giving the value as if all 8 digits were there; then drop the places of the absent ones.
    v = digit
    for bits, mask in ((8, 0x00FF00FF00FF00FF), (16, 0x0000FFFF0000FFFF), (32, 0xFFFFFFFF)):
        high, low = v & np.uint64(mask), (v >> np.uint64(bits)) & np.uint64(mask)
        v = high * _POW[base][bits // 8] + low
    return v // _POW[base][8 - ln], bad


def _parse_fields(words: np.ndarray, st: np.ndarray, ln: np.ndarray, base: int, max_digits: int):
    """Values of fields of 1 to ``max_digits`` digits starting at byte ``st`` with length ``ln``
    (0 = missing, value 0), 8 digits per word; and a mask of malformed fields."""
    value = np.zeros(st.shape, np.uint64)
    bad = ln > max_digits
    for k in range(0, int(np.minimum(ln, max_digits).max(initial=0)), 8):
        part_len = np.clip(ln - k, 0, 8)
        part, part_bad = _parse_words(words[st + k], part_len, base)
        value = value * _POW[base][part_len] + part
        bad |= part_bad
    return value, bad


def _parse_lines(buf: np.ndarray, a: int, b: int, line_numbers: np.ndarray, path) -> tuple:
    """Parse the whole lines in ``buf[a:b]`` (each ending in ``\\n``; ``buf`` goes on for at
    least _PAD bytes after ``b``) into raw arrays; ``line_numbers`` are their 1-based numbers in
    ``path``, for errors."""
    is_nl = buf[a:b] == 10
    sep = np.flatnonzero(is_nl | (buf[a:b] == 9))
    nfields = np.diff(np.flatnonzero(is_nl[sep]), prepend=-1)
    if np.any(nfields != N_FIELDS):
        i = int(np.argmax(nfields != N_FIELDS))
        raise ValueError(
            f"{path}: line {line_numbers[i]}: expected {N_FIELDS} tab-separated fields, got {nfields[i]}"
        )
    starts = np.empty_like(sep)
    starts[0], starts[1:] = a, sep[:-1] + (a + 1)
    starts = starts.reshape(-1, N_FIELDS)
    lens = sep.reshape(-1, N_FIELDS) + a - starts

    first = buf[starts[:, 0]]
    label_bad = (lens[:, 0] != 1) | ((first | 1) != ord("1"))  # only '0' and '1' survive | 1 as '1'
    # Every byte offset as the start of an (unaligned) little-endian uint64: one gather reads 8 bytes.
    words = np.ndarray((len(buf) - 7,), "<u8", buf, 0, (1,))
    st, ln = starts[:, 1 : 1 + N_DENSE], lens[:, 1 : 1 + N_DENSE]
    neg = buf[st] == ord("-")
    dense, dense_bad = _parse_fields(words, st + neg, ln - neg, 10, _MAX_DIGITS)
    dense_bad |= neg & (ln == 1)
    dense = np.where(neg, -dense.astype(np.int64), dense.astype(np.int64))
    st, ln = starts[:, 1 + N_DENSE :], lens[:, 1 + N_DENSE :]
    cat, cat_bad = _parse_fields(words, st, ln, 16, 8)
    problems = [
        (label_bad[:, None], 0, "label must be 0 or 1"),
        (dense_bad, 1, "dense column is not an integer"),
        (cat_bad, 1 + N_DENSE, "categorical column is not hex of 1 to 8 digits"),
    ]
    found = [(int(np.argmax(bad.any(1))), field0, bad, msg) for bad, field0, msg in problems if bad.any()]
    if found:  # report the first bad line, and its first bad field
        row, field0, bad, msg = min(found, key=lambda f: f[:2])
        field = field0 + int(np.argmax(bad[row])) + 1
        raise ValueError(f"{path}: line {line_numbers[row]}: field {field}: {msg}")
    label = (first == ord("1")).astype(np.float32)
    return dense, lens[:, 1 : 1 + N_DENSE] == 0, cat.astype(np.uint32), ln == 0, label


def read_criteo_tsv(path, limit: int | None = None) -> CtrData:
    """Read and featurize a Criteo-format TSV (see the module docstring); at most ``limit``
    examples if given. Accepts upper- or lower-case hex of 1 to 8 digits, ``\\n`` or ``\\r\\n``
    line ends, with or without a final newline. A bad line (wrong field count, non-integer dense
    value, non-hex categorical value, label not 0/1) raises ValueError naming the file and its
    1-based line number. Reads the whole file into memory: ``ctr_stream`` streams it instead."""
    with open(path, "rb") as f:
        data = f.read() if limit is None else b"".join(itertools.islice(f, max(0, int(limit))))
    if b"\r" in data:
        data = data.replace(b"\r\n", b"\n")
    if data and not data.endswith(b"\n"):
        data += b"\n"
    return parse_lines(data, np.arange(1, data.count(b"\n") + 1), path)


def parse_lines(data: bytes, line_numbers: np.ndarray, path) -> CtrData:
    """Featurized examples of ``data``, whole Criteo lines each ending in ``\\n`` (no ``\\r``);
    ``line_numbers`` (one per line, 1-based) and ``path`` name a bad line in the ValueError, as
    :func:`read_criteo_tsv` does. Parsing is vectorised over the bytes with numpy, in chunks of
    lines."""
    buf = np.frombuffer(data + b"\0" * _PAD, np.uint8)
    nl = np.flatnonzero(buf[: len(data)] == 10)
    n = len(nl)
    if len(line_numbers) != n:
        raise ValueError(f"{n} lines but {len(line_numbers)} line numbers")
    # Filled chunk by chunk: concatenating per-chunk arrays would touch every byte twice more.
    out = CtrData(
        np.empty((n, N_DENSE), np.float32), np.empty((n, N_SPARSE), np.int64), np.empty(n, np.float32)
    )
    for i in range(0, n, _CHUNK_LINES):
        j = min(i + _CHUNK_LINES, n)
        a, b = (0 if i == 0 else int(nl[i - 1]) + 1), int(nl[j - 1]) + 1
        raw_dense, dense_missing, raw_cat, cat_missing, out.label[i:j] = _parse_lines(
            buf, a, b, line_numbers[i:j], path
        )
        out.dense[i:j] = _dense_features(raw_dense, dense_missing)
        out.ids[i:j] = slot_ids(raw_cat, cat_missing)
    return out
