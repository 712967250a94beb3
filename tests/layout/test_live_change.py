"""A running sync job changes its pserver count while its trainers train, asked as ``ps-reshard`` asks:
2 -> 3 -> 2 pservers, no process restarted (each pserver serves its next layout from the switch step, a
new one joins, one leaves), the trainers told "moved" and pushing the step again there; the model equals
one process on the same batches (float64), no step repeated or rolled back."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from harness.cluster import in_threads
from harness.models import assert_state_close, odd_program, train_concatenated
from harness.models import batches as odd_batches
from harness.ports import free_ports
from pserver import ParameterServer
from pserver.layout import switch
from pserver.layout.reshard_cli import ChangeNotMade, ask_change
from pserver.layout.stores import FileLayoutStore
from psproto.security import Security
from tests.helpers.table_models import (
    BAG_VOCAB,
    VOCAB,
    counting_program,
    single_process,
    table_batches,
    table_program,
)
from tests.tables.test_sync import assert_matches
from trainer import Trainer
from transpiler import DistributeTranspiler, DistributeTranspilerConfig
from transpiler.layout.change import LayoutChangeRefused

STEPS = 12


class Job:
    """Pservers serving their job's layouts in threads (as ``ps-server`` does), trainers in threads."""

    def __init__(self, config, pservers, trainers: int, build, sync_mode: bool = True):
        self.config, self.trainers, self.build, self.sync_mode = config, trainers, build, sync_mode
        self.pservers = list(pservers)
        self.threads, self.errors = [], []
        self.store = FileLayoutStore(config.checkpoint_dir)
        self.asked, self._asking = [], None

    def transpiler(self, pservers, trainer_id: int = 0) -> DistributeTranspiler:
        t = DistributeTranspiler(self.config)
        t.transpile(trainer_id, self.build(), ",".join(pservers), self.trainers, sync_mode=self.sync_mode)
        return t

    def ask(self, pservers, new_pserver=None) -> None:
        """``ps-reshard`` for ``pservers``, in a thread (once the change asked before has finished); the new
        pserver ``new_pserver`` is started once the change is recorded (it waits for the commit)."""
        if self._asking is not None:
            self._asking.join(60)

        def ask() -> None:
            self.asked.append(ask_change(self.store, pservers, timeout=60))

        self._asking = threading.Thread(target=ask, daemon=True)
        self._asking.start()
        while self.store.read().change is None and self._asking.is_alive():
            time.sleep(0.01)
        if new_pserver is not None:
            self.start_pserver(new_pserver, pservers)

    def start_pserver(self, endpoint: str, pservers) -> None:
        """``ps-server`` at ``endpoint`` given ``pservers``."""
        t = self.transpiler(pservers)
        program = t.get_pserver_program(endpoint)

        def serve() -> None:
            try:  # in the layout the record names (waiting for the change adding it), then each next one
                ParameterServer(
                    program, t.get_startup_program(endpoint, program), security=Security()
                ).serve()
            except BaseException as e:  # reported by the test
                self.errors.append(e)

        thread = threading.Thread(target=serve, name=f"pserver-{endpoint}", daemon=True)
        thread.start()
        self.threads.append(thread)

    def trainer(self, i: int) -> Trainer:
        return Trainer(self.transpiler(self.pservers, i).get_trainer_program(), Security())

    def join(self, timeout: float) -> None:
        for thread in self.threads:
            thread.join(timeout)
            assert not thread.is_alive(), f"{thread.name} still serves"
        assert not self.errors, self.errors


@pytest.mark.timeout(150)
@pytest.mark.parametrize("kind", ["tables", "dense"])
def test_a_sync_job_goes_from_2_to_3_to_2_pservers_live_and_equals_one_process(tmp_path, kind):
    """``tables``: two distributed tables (Adagrad) and a dense head, the trainers learning of each change
    from a lookup; ``dense``: parameters sliced into blocks whose cut depends on the pserver count (Adam),
    no lookups, so the trainers learn of it from their step's push ("moved" once the pservers stopped)
    and push the step again in the next layout."""
    tables = kind == "tables"
    if tables:
        build, data = (lambda: table_program("adagrad", torch.float64)), table_batches(2, 4, STEPS, seed=7)
    else:
        build, data = odd_program, odd_batches(2, 4, STEPS, dtype=torch.float64)
    directory = str(tmp_path / "checkpoints")
    config = DistributeTranspilerConfig(
        checkpoint_dir=directory, heartbeat_timeout=10.0, min_block_size=8192, slice_var_up=not tables
    )
    a, b, c = (f"127.0.0.1:{p}" for p in free_ports(3))
    job = Job(config, [a, b], 2, build)
    for ep in (a, b):
        job.start_pserver(ep, [a, b])
    changes, step_times = {3: [a, b, c], 7: [a, b]}, {0: [], 1: []}
    steps_seen = {0: [], 1: []}

    def body(i: int):
        with job.trainer(i) as tr:
            for *x, y in (step_batches[i] for step_batches in data):
                started = time.monotonic()  # the change lands in a lookup (forward) or a push (step)
                nn.functional.cross_entropy(tr.model(*x), y).backward()
                step = tr.step()
                step_times[i].append(time.monotonic() - started)
                steps_seen[i].append(step)
                if i == 0 and step == 7:  # what Stats says of the job's layout between its changes
                    stats = tr.channels.stats(10)
                    assert sorted(stats) == sorted([a, b, c])
                    for r in stats.values():
                        assert (r.layout_epoch, r.layout_change, r.layout_parts_to_move) == (1, "", 0)
                        assert 0 < r.layout_change_s < 30  # the last change, from the ask to the commit
                if i == 0 and step in changes:
                    job.ask(changes[step], c if step == 3 else None)
                    if step == 3:  # a second change while one is in progress is refused, changing nothing
                        with pytest.raises(LayoutChangeRefused, match="in progress"):
                            ask_change(job.store, [a], timeout=1)
            rows = {"emb": VOCAB, "bag": BAG_VOCAB} if tables else {}
            model = (tr.state_dict(), {t: tr.pull_rows(t, torch.from_numpy(ids)) for t, ids in rows.items()})
            return model, tr.program.layout_epoch, list(tr.program.pservers)

    results = in_threads({i: (lambda i=i: body(i)) for i in (0, 1)}, timeout=120)
    job.join(30)
    asked = job.asked
    assert [(r.epoch, r.pservers) for r in asked] == [(1, [a, b, c]), (2, [a, b])]
    assert 3 < asked[0].since_step < 7 < asked[1].since_step < STEPS
    for i in (0, 1):
        if tables:
            assert_matches(results[i][0], single_process(build(), data))
        else:
            assert_state_close(results[i][0][0], train_concatenated(build(), data), atol=1e-10)
        assert results[i][1:] == (2, [a, b])
        assert steps_seen[i] == list(range(1, STEPS + 1))  # no step repeated, none rolled back
    print(f"longest step {max(max(t) for t in step_times.values()):.2f}s")


@pytest.mark.timeout(150)
def test_an_async_job_applies_every_acknowledged_push_once_across_two_live_changes(tmp_path):
    """Each trainer's pushes from its switch step on are refused by every pserver (none applies a part of
    one), and go again, whole, in the next layout. A change completes once each live trainer has pushed up
    to its switch step: the trainers train on (their batches in turn) until both changes are made."""
    batches = torch.from_numpy(
        VOCAB[torch.randint(0, len(VOCAB), (2, STEPS, 6), generator=torch.Generator().manual_seed(3)).numpy()]
    )
    config = DistributeTranspilerConfig(checkpoint_dir=str(tmp_path / "checkpoints"), heartbeat_timeout=10.0)
    a, b, c = (f"127.0.0.1:{p}" for p in free_ports(3))
    job = Job(config, [a, b], 2, counting_program, sync_mode=False)
    for ep in (a, b):
        job.start_pserver(ep, [a, b])
    bias0 = float(counting_program().model.count.bias.detach())
    everyone_pushed = threading.Barrier(2)

    def body(i: int):
        pushed = []
        with job.trainer(i) as tr:
            while len(pushed) < STEPS or len(job.asked) < 2 or tr.program.layout_epoch < 2:
                ids = batches[i][len(pushed) % STEPS]
                tr.model(ids).backward()
                step = tr.step()
                pushed.append(ids)
                if i == 0 and step in (3, 7):
                    job.ask([a, b, c] if step == 3 else [a, b], c if step == 3 else None)
                assert len(pushed) < 500, "the changes were not made"
            everyone_pushed.wait(60)  # every push of both trainers acknowledged
            bias, rows = float(tr.state_dict()["count.bias"]), tr.pull_rows("emb", torch.from_numpy(VOCAB))
            return bias, rows, torch.cat(pushed)

    results = in_threads({i: (lambda i=i: body(i)) for i in (0, 1)}, timeout=120)
    job.join(30)
    assert [(r.epoch, r.pservers) for r in job.asked] == [(1, [a, b, c]), (2, [a, b])]
    looked_up = torch.cat([ids for _, _, ids in results.values()])
    counts = torch.bincount(torch.searchsorted(torch.from_numpy(VOCAB), looked_up), minlength=len(VOCAB))
    pushes = sum(len(ids) for _, _, ids in results.values()) // 6
    expected = bias0
    for _ in range(pushes):  # one step of SGD each, rounded as the pserver rounds it
        expected -= 1.0
    for bias, rows, _ in results.values():
        assert bias == expected  # every push's bias gradient applied once
        assert torch.equal(rows, -counts.to(torch.float64)[:, None].expand(-1, 2))  # each lookup once


@pytest.mark.timeout(120)
def test_a_count_the_state_does_not_fit_is_refused_and_the_job_goes_on(tmp_path, monkeypatch):
    """Shrinking 2 -> 1 where the staying pserver's host has too little memory for the whole state: the
    pserver rolls the change back before anything moves, ps-reshard says why, the job trains on unchanged
    and equals one process."""
    monkeypatch.setattr(switch, "available_memory", lambda: 1000)  # 800 bytes to spare: far too few
    data = table_batches(2, 4, STEPS, seed=7)
    build = lambda: table_program("adagrad", torch.float64)  # noqa: E731
    config = DistributeTranspilerConfig(checkpoint_dir=str(tmp_path / "checkpoints"), heartbeat_timeout=10.0)
    a, b = (f"127.0.0.1:{p}" for p in free_ports(2))
    job = Job(config, [a, b], 2, build)
    for ep in (a, b):
        job.start_pserver(ep, [a, b])
    refusals, asking = [], []

    def body(i: int):
        with job.trainer(i) as tr:
            for ids, bag, y in (step_batches[i] for step_batches in data):
                nn.functional.cross_entropy(tr.model(ids, bag), y).backward()
                if tr.step() == 3 and i == 0:
                    asking.append(threading.Thread(target=lambda: refusals.append(refused(job.store, [a]))))
                    asking[-1].start()
            rows = {"emb": VOCAB, "bag": BAG_VOCAB}
            return (tr.state_dict(), {t: tr.pull_rows(t, torch.from_numpy(v)) for t, v in rows.items()})

    def refused(store, pservers) -> str:
        with pytest.raises(ChangeNotMade) as e:
            ask_change(store, pservers, timeout=30)
        return str(e.value)

    results = in_threads({i: (lambda i=i: body(i)) for i in (0, 1)}, timeout=100)
    asking[0].join(30)
    job.join(30)
    assert len(refusals) == 1 and "do not fit 1 pservers" in refusals[0], refusals
    record = job.store.read()
    assert (record.epoch, record.pservers, record.change) == (0, [a, b], None)
    for i in (0, 1):
        assert_matches(results[i], single_process(build(), data))
