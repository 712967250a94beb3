"""CTR examples streamed per trainer: a ``torch.utils.data.IterableDataset`` of batches over a record source.

Records. A *source* is a numbered sequence of examples, read front to back in
blocks: :class:`CriteoFile` (the lines ``[start, stop)`` of a Criteo-format TSV)
or :class:`Generated` (examples of ``ctr_data``'s planted model, drawn in units
of ``unit`` records, each from its own seed). A source parses or draws only the
records it is asked for; a file is still scanned end to end for line breaks,
which costs far less than parsing.

Sharding (pure functions, :func:`shard_sizes` / :func:`assign`). Record ``i``
belongs to unit ``i // unit`` (a file: every line is a unit) and unit ``u`` to
trainer ``u % shards``: every record goes to exactly one trainer, and the
trainers' shards differ by at most one unit. A trainer's records, in source
order, are cut into batches of ``batch_size``: batch ``k`` holds its records
``[k * batch_size, (k + 1) * batch_size)``. With DataLoader workers, batch
``k`` is read by worker ``k % num_workers`` (``get_worker_info()``), and since
the DataLoader takes one batch from each worker in turn, it hands them out in
the order ``0, 1, 2, ...``: the batches, their contents and their order are the
same for any number of workers.

An epoch is the same sequence every time (no shuffling: shuffle a sorted file
once beforehand), so a trainer's data position (epoch, batch) names one batch
for good, and ``Trainer.batches`` resumes a restarted trainer exactly at it.
"""

from __future__ import annotations

import os
from typing import Callable, Iterator, Optional, Tuple

import ctr_data
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

READ_BYTES = 4 << 20  # a file is read in blocks of about this many bytes
UNIT = 1024  # records per generated unit: one seed, one draw


def shard_sizes(records: int, shards: int, unit: int = 1) -> np.ndarray:
    """Records of each shard when unit ``u`` (records ``[u * unit, (u + 1) * unit)``) goes to shard ``u %
    shards``."""
    if records < 0 or shards < 1 or unit < 1:
        raise ValueError(f"need records >= 0, shards >= 1, unit >= 1; got {records}, {shards}, {unit}")
    full, rest = divmod(records, unit)
    shard = np.arange(shards)
    sizes = unit * np.maximum(0, (full - shard + shards - 1) // shards)
    sizes[full % shards] += rest
    return sizes


def assign(index: np.ndarray, shards: int, unit: int, batch_size: int) -> Tuple[np.ndarray, np.ndarray]:
    """(shard, batch) of each record number in ``index``: the trainer that reads it and its batch there.

    Unit ``u`` is the ``u // shards``-th unit of its shard, and every unit
    before it in that shard is full, so the record's rank in its shard is
    ``(u // shards) * unit + i % unit``.
    """
    index = np.asarray(index, np.int64)
    unit_no = index // unit
    rank = (unit_no // shards) * unit + index % unit
    return unit_no % shards, rank // batch_size


def batches_per_epoch(records: int, shards: int, unit: int, batch_size: int, shard: int, even: bool) -> int:
    """Batches of ``shard`` per epoch: all of them (the last one may be short), or with ``even``
    only full ones, as many as the smallest shard has, so every trainer takes the same number of steps."""
    sizes = shard_sizes(records, shards, unit)
    if even:
        return int(sizes.min()) // batch_size
    return -(-int(sizes[shard]) // batch_size)


class CriteoFile:
    """The lines ``[start, stop)`` of a Criteo-format TSV (``stop=None``: to the end) as a record source.

    Counting the lines reads the file (line breaks only, up to ``stop``) when made.
    Lines end in ``\\n`` or ``\\r\\n``; the last may lack it. A bad line raises
    ValueError naming the file and its line, when a reader parses it.
    """

    unit = 1

    def __init__(self, path, start: int = 0, stop: Optional[int] = None):
        if start < 0 or (stop is not None and stop < start):
            raise ValueError(f"bad line range [{start}, {stop})")
        self.path = os.fspath(path)
        self.start = start
        lines, self._offset = _count_lines(self.path, start, stop)
        self.stop = lines if stop is None else min(stop, lines)
        self.start = min(start, self.stop)

    def __len__(self) -> int:
        """The number of records (lines in the range)."""
        return self.stop - self.start

    def read(self, want: Callable[[np.ndarray], np.ndarray]) -> Iterator[Tuple[np.ndarray, ctr_data.CtrData]]:
        """(record numbers, their examples) of the records ``want(numbers)`` selects, block by block, in
        order."""
        first = 0  # record number of the block's first line
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            tail = b""
            while first < len(self):
                block = f.read(READ_BYTES)
                data = tail + block
                end = data.rfind(b"\n") + 1
                if not block:  # the end of the file; a last line without its newline
                    data, end = data + b"\n", len(data) + 1
                    if end == 1:
                        return
                data, tail = data[:end], data[end:]
                buf = np.frombuffer(data, np.uint8)
                line_end = np.flatnonzero(buf == 10)[: len(self) - first]
                numbers = first + np.arange(len(line_end))
                first += len(line_end)
                mine = want(numbers)
                if mine.any():
                    if mine.all() and line_end[-1] + 1 == len(data) and b"\r" not in data:
                        picked = data  # every line of the block, as it is
                    else:
                        line_start = np.concatenate([[0], line_end[:-1] + 1])[mine]
                        picked = _gather_lines(data, line_start, line_end[mine])
                    numbers = numbers[mine]
                    yield numbers, ctr_data.parse_lines(picked, self.start + numbers + 1, self.path)


def _count_lines(path: str, start: int, stop: Optional[int]) -> Tuple[int, int]:
    """(lines in the file, or ``stop`` if it has at least that many; byte offset of line ``start``, or the
    end)."""
    lines, offset, pos = 0, None, 0
    with open(path, "rb") as f:
        last = b"\n"
        while block := f.read(READ_BYTES):
            count = block.count(b"\n")
            if offset is None and lines + count >= start:
                if start == 0:
                    offset = 0
                else:  # just past the start-th line break
                    ends = np.flatnonzero(np.frombuffer(block, np.uint8) == 10)
                    offset = pos + int(ends[start - lines - 1]) + 1
            lines, pos, last = lines + count, pos + len(block), block[-1:]
            if offset is not None and stop is not None and lines >= stop:
                return stop, offset  # the rest of the file is not needed
    lines += last != b"\n"
    return lines, pos if offset is None else offset


def _gather_lines(data: bytes, start: np.ndarray, end: np.ndarray) -> bytes:
    """The lines ``data[start:end + 1]`` (``end`` at their ``\\n``) one after another, ``\\r\\n`` made
    ``\\n``."""
    # bytes slices are memcpy: far cheaper than an index per byte, even with a Python step per line.
    out = b"".join([data[a:b] for a, b in zip(start.tolist(), (end + 1).tolist())])
    return out.replace(b"\r\n", b"\n") if b"\r" in out else out


class Generated:
    """``records`` examples of ``ctr_data``'s planted model for ``seed``, as a record source.

    Unit ``u`` (records ``[u * UNIT, (u + 1) * UNIT)``) is drawn with sample seed
    ``(stream, u)``: a record depends only on (seed, stream, its number), never
    on trainers or workers; another ``stream`` is another sample of the same model.
    """

    unit = UNIT

    def __init__(self, records: int, seed: int = 0, stream: int = 0, vocab_size: int = 100_000):
        self.records, self.seed, self.stream, self.vocab_size = int(records), seed, stream, vocab_size

    def __len__(self) -> int:
        """The number of records."""
        return self.records

    def read(self, want: Callable[[np.ndarray], np.ndarray]) -> Iterator[Tuple[np.ndarray, ctr_data.CtrData]]:
        """(record numbers, their examples) of the records ``want(numbers)`` selects, unit by unit, in
        order."""
        for first in range(0, self.records, self.unit):
            numbers = np.arange(first, min(first + self.unit, self.records))
            mine = want(numbers)
            if mine.any():
                data = ctr_data.generate(
                    len(numbers), self.seed, self.vocab_size, sample_seed=(self.stream, first // self.unit)
                )
                yield numbers[mine], data.subset(mine)


class CtrStream(IterableDataset):
    """Batches ``(dense float32 (b, 13), ids int64 (b, 26), label float32 (b,))`` of shard ``shard`` of
    ``source``.

    See the module docstring for which records and in which order. With ``even`` (training) every shard
    yields the same number of full batches (:func:`batches_per_epoch`); without it, every record of the
    shard, the last batch possibly short (evaluation, or a single trainer). Use it with
    ``DataLoader(stream, batch_size=None, ...)`` (see :func:`loader`).
    """

    def __init__(self, source, batch_size: int, shard: int = 0, shards: int = 1, even: bool = True):
        if batch_size < 1 or not 0 <= shard < shards:
            raise ValueError(
                f"need batch_size >= 1 and 0 <= shard < shards; got {batch_size}, {shard}, {shards}"
            )
        self.source, self.batch_size, self.shard, self.shards = source, batch_size, shard, shards
        self.batches = batches_per_epoch(len(source), shards, source.unit, batch_size, shard, even)

    def __len__(self) -> int:
        """Batches per epoch."""
        return self.batches

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        worker = get_worker_info()
        workers, me = (1, 0) if worker is None else (worker.num_workers, worker.id)

        def want(numbers: np.ndarray) -> np.ndarray:
            shard, batch = assign(numbers, self.shards, self.source.unit, self.batch_size)
            return (shard == self.shard) & (batch % workers == me) & (batch < self.batches)

        parts, current = [], None
        for numbers, data in self.source.read(want):
            _, batch = assign(numbers, self.shards, self.source.unit, self.batch_size)
            # A batch's records come in order and together: a new batch number ends the last batch.
            cuts = np.flatnonzero(np.diff(batch)) + 1
            for a, b in zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [len(batch)]])):
                if batch[a] != current and parts:
                    yield _tensors(parts)
                    parts = []
                current = batch[a]
                parts.append(data.subset(slice(a, b)))
        if parts:
            yield _tensors(parts)


def _tensors(parts) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Always a copy: a view would keep (and send to the main process) its whole block.
    data = ctr_data.CtrData.concat(parts)
    return torch.from_numpy(data.dense), torch.from_numpy(data.ids), torch.from_numpy(data.label)


def loader(stream: CtrStream, workers: int = 0) -> DataLoader:
    """A DataLoader over ``stream``'s batches, read by ``workers`` processes (0: where it is iterated).

    Workers start from a fresh ``forkserver`` process rather than a fork of this
    one (a trainer runs gRPC threads, which must not be forked), once: they
    persist across epochs.
    """
    if workers == 0:
        return DataLoader(stream, batch_size=None)
    return DataLoader(
        stream,
        batch_size=None,
        num_workers=workers,
        multiprocessing_context="forkserver",
        persistent_workers=True,
    )


def stop_workers(loader: DataLoader) -> None:
    """Stop ``loader``'s worker processes now, on this thread (nothing when it has none running).

    Persistent workers otherwise stop whenever the loader's iterator is freed, which may be on
    another thread or while the interpreter exits: a semaphore of its queues can then be unlinked
    without being unregistered, and Python's resource tracker warns of a "leaked semaphore" after
    the trainer's last line (seen once in CI). torch has no public call for this: it keeps the
    persistent workers' iterator in ``_iterator``.
    """
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
        loader._iterator = None
