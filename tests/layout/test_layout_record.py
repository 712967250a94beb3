"""The layout record: its bytes, the phases of a change as pure transitions (table-driven), the decision a
death takes, and compare-and-set in a file and in etcd (two writers: one wins, the other reads again)."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from pserver.layout import phases
from pserver.layout.stores import EtcdLayoutStore, FileLayoutStore, StaleRecord, update
from tests.helpers.etcd import etcd_fixture  # noqa: F401 - the `etcd` fixture
from transpiler.layout.change import LayoutChangeRefused
from transpiler.layout.record import LayoutChange, LayoutRecord

A, B, C = "127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:7003"
NOW = LayoutRecord(epoch=3, pservers=[A, B])


def test_a_record_round_trips_and_malformed_bytes_are_refused():
    r = phases.switch_at(phases.start_copying(phases.ask(NOW, [A, B, C], now=12.5)), 40)
    assert LayoutRecord.from_bytes(r.to_bytes(), revision=7) == r.with_revision(7)
    for bad, message in [
        (b"{", "not a layout record"),
        (b'{"format": "x"}', "not a layout record"),
        (b'{"format": "torch-pserver-layout", "version": 9}', "version 9"),
        (b'{"format": "torch-pserver-layout", "version": 1}', "malformed layout record"),
    ]:
        with pytest.raises(ValueError, match=message):
            LayoutRecord.from_bytes(bad)


def test_a_change_goes_asked_copying_switching_and_commits_once_every_pserver_involved_reported():
    r = phases.ask(NOW, [A, B, C], now=1.0)
    assert r.change == LayoutChange(4, [A, B, C], [], "asked", None, [], 1.0)
    assert phases.involved(r) == [A, B, C]
    assert (phases.epoch_of(r, A), phases.epoch_of(r, C), phases.epoch_of(r, "x:1")) == (3, 4, None)
    r = phases.switch_at(phases.start_copying(r), 40)
    assert (r.change.phase, r.change.switch_step) == ("switching", 40)
    for ep in (C, A):
        r = phases.report_switched(r, ep)
        assert r.epoch == 3 and r.change.switched == sorted({C, A} & set(r.change.switched))
    r = phases.report_switched(r, B)
    assert r == LayoutRecord(4, [A, B, C])
    # Shrinking back: the removed pserver is involved until the commit.
    r = phases.ask(r, [A, B])
    assert phases.involved(r) == [A, B, C]


@pytest.mark.parametrize(
    "transition, phase, message",
    [
        (lambda r: phases.start_copying(r), "copying", "it must be asked"),
        (lambda r: phases.switch_at(r, 5), "asked", "it must be copying"),
        (lambda r: phases.report_switched(r, A), "copying", "it must be switching"),
        (lambda r: phases.rolled_back(r), "switching", "it must be rolling_back"),
        (lambda r: phases.ask(r, [A]), "asked", "a change to layout epoch 4 is in progress"),
        (lambda r: phases.report_switched(r, "10.0.0.9:1"), "switching", "not one of the pservers"),
    ],
)
def test_a_transition_out_of_its_phase_is_refused(transition, phase, message):
    r = dataclasses.replace(NOW, change=LayoutChange(4, [A, B, C], phase=phase))
    with pytest.raises(LayoutChangeRefused, match=message):
        transition(r)


@pytest.mark.parametrize(
    "transition, message",
    [
        (lambda r: phases.ask(r, []), "at least one pserver"),
        (lambda r: phases.ask(r, [A, B]), "already runs"),
        (lambda r: phases.start_copying(r), "no change of layout is in progress"),
        (lambda r: phases.ask(dataclasses.replace(r, replicas=["h:1", "h:2"]), [A, B, C], ["h:1"]), "backup"),
    ],
)
def test_a_bad_ask_is_refused(transition, message):
    with pytest.raises(LayoutChangeRefused, match=message):
        transition(NOW)


@pytest.mark.parametrize(
    "phase, endpoint, role, decision",
    [
        (None, A, "pserver", phases.GO_ON),  # no change: an ordinary death
        ("asked", C, "pserver", phases.ROLL_BACK),  # a new pserver
        ("copying", A, "pserver", phases.ROLL_BACK),  # an old owner
        ("switching", B, "pserver", phases.ROLL_BACK),
        ("switching", C, "pserver", phases.ROLL_BACK),
        ("switching", "127.0.0.1:9", "pserver", phases.GO_ON),  # not part of the change
        ("switching", "trainer-0", "trainer", phases.GO_ON),
        ("rolling_back", A, "pserver", phases.GO_ON),  # already being undone
    ],
)
def test_a_death_before_the_commit_rolls_the_change_back(phase, endpoint, role, decision):
    r = NOW if phase is None else dataclasses.replace(NOW, change=LayoutChange(4, [A, B, C], phase=phase))
    assert phases.on_death(r, endpoint, role) == decision


def test_rolling_back_leaves_the_current_layout():
    r = phases.roll_back(phases.switch_at(phases.start_copying(phases.ask(NOW, [A, B, C])), 9), "C died")
    assert (r.change.phase, r.change.why) == ("rolling_back", "C died")
    assert phases.rolled_back(r) == dataclasses.replace(NOW, rolled_back="C died")  # says why, for ps-reshard


def two_writers(store):
    """Two threads ask for a change at once: one is recorded, the other refused as in progress."""
    outcomes = []
    go = threading.Barrier(2)

    def ask(pservers):
        go.wait()
        try:
            outcomes.append(update(store, lambda r: phases.ask(r, pservers), NOW).change.pservers)
        except LayoutChangeRefused as e:
            outcomes.append(str(e))

    threads = [threading.Thread(target=ask, args=(p,)) for p in ([A, B, C], [A])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(outcomes) == 2
    recorded = store.read().change.pservers
    assert recorded in outcomes
    (refused,) = [o for o in outcomes if o != recorded]
    assert "is in progress" in refused
    return recorded


def test_the_file_store_compares_and_sets(tmp_path):
    store = FileLayoutStore(str(tmp_path))
    assert store.read() is None
    first = store.swap(None, NOW)
    assert first.revision == 1 and FileLayoutStore(str(tmp_path)).read() == first
    with pytest.raises(StaleRecord):
        store.swap(None, NOW)
    with pytest.raises(StaleRecord):
        store.swap(NOW.with_revision(5), NOW)
    (tmp_path / "layout.json").unlink()
    two_writers(store)


def test_the_etcd_store_compares_and_sets(etcd):
    store = EtcdLayoutStore(etcd.url, "/jobs/test")
    try:
        assert store.read() is None
        first = store.swap(None, NOW)
        assert store.read() == first
        with pytest.raises(StaleRecord):
            store.swap(None, NOW)
        second = store.swap(first, phases.ask(first, [A, B, C]))
        assert second.revision > first.revision and store.read() == second
        with pytest.raises(StaleRecord):
            store.swap(first, NOW)
    finally:
        store.close()
    two_writers(EtcdLayoutStore(etcd.url, "/jobs/other"))
