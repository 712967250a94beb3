"""The layout record: its bytes, the phases of a change as pure transitions (table-driven), what Stats shows
of it, the layout a role starts in, and compare-and-set in a file and in etcd (two writers: one wins, the
other reads again)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
import types

import pytest

from pserver.layout import phases
from pserver.layout.stores import EtcdLayoutStore, FileLayoutStore, StaleRecord, update
from pserver.replication.coordination import shards_prefix
from tests.helpers.etcd import etcd_fixture  # noqa: F401 - the `etcd` fixture
from transpiler.layout import starting
from transpiler.layout.change import LayoutChangeRefused, moved_message, moved_to
from transpiler.layout.record import LayoutChange, LayoutRecord

A, B, C = "127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:7003"
NOW = LayoutRecord(epoch=3, pservers=[A, B])
PAIRED = dataclasses.replace(NOW, replicas=["h:1", "h:2"])  # hot standby: each pserver with its backup


def test_a_record_round_trips_and_malformed_bytes_are_refused():
    r = phases.schedule_switch(phases.ask(NOW, [A, B, C], now=12.5), None, {0: 4, 1: 9})
    assert LayoutRecord.from_bytes(r.to_bytes(), revision=7) == r.with_revision(7)
    for bad, message in [
        (b"{", "not a layout record"),
        (b'{"format": "x"}', "not a layout record"),
        (b'{"format": "torch-pserver-layout", "version": 9}', "version 9"),
        (b'{"format": "torch-pserver-layout", "version": 1}', "malformed layout record"),
    ]:
        with pytest.raises(ValueError, match=message):
            LayoutRecord.from_bytes(bad)


def test_a_change_is_asked_scheduled_and_commits_once_every_current_pserver_wrote_its_part():
    r = phases.ask(NOW, [A, B, C], now=1.0)
    assert r.change == LayoutChange(4, [A, B, C], phase="asked", asked_at=1.0)
    r = phases.schedule_switch(r, 40)
    assert (r.change.phase, r.change.switch_step, r.change.switch_steps) == ("switching", 40, {})
    assert phases.status_of(r) == phases.LayoutStatus(
        "switching to epoch 4 (3 pservers) after step 40", 0, 2, epoch=3
    )
    r = phases.report_saved(r, B, now=3.0)
    assert (r.epoch, r.change.switched, phases.status_of(r).moved) == (3, [B], 1)
    r = phases.report_saved(r, A, now=3.5)
    assert r == LayoutRecord(4, [A, B, C], since_step=40, history=[[A, B]], last_change_s=2.5)
    assert phases.status_of(r) == phases.LayoutStatus(last_change_s=2.5, epoch=4)
    # Shrinking back: every current pserver, the one that leaves too, writes its part.
    r = phases.schedule_switch(phases.ask(r, [A, B]), 50)
    for ep in (C, A, B):
        r = phases.report_saved(r, ep)
    assert (r.epoch, r.pservers, r.since_step, r.history) == (5, [A, B], 50, [[A, B], [A, B, C]])


def test_an_async_switch_names_each_trainers_step():
    r = phases.schedule_switch(phases.ask(NOW, [A, B, C]), None, {0: 7, 1: 3})
    assert (r.change.switch_step, r.change.switch_steps) == (None, {"0": 7, "1": 3})
    assert "at each trainer's switch step" in phases.status_of(r).change
    r = phases.report_saved(phases.report_saved(r, A), B)
    assert (r.epoch, r.since_step) == (4, -1)


@pytest.mark.parametrize(
    "transition, phase, message",
    [
        (lambda r: phases.schedule_switch(r, 5), "switching", "it must be asked"),
        (lambda r: phases.report_saved(r, A), "asked", "it must be switching"),
        (lambda r: phases.rolled_back(r), "switching", "it must be rolling_back"),
        (lambda r: phases.ask(r, [A]), "asked", "a change to layout epoch 4 is in progress"),
        (lambda r: phases.report_saved(r, C), "switching", "not one of the current pservers"),
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
        (lambda r: phases.ask(r, [""]), "at least one pserver"),
        (lambda r: phases.ask(r, ["nohost"]), "host:port"),
        (lambda r: phases.ask(r, [A, A]), "twice"),
        (lambda r: phases.ask(r, [A, B]), "already runs"),
        (lambda r: phases.schedule_switch(r, 3), "no change of layout is in progress"),
        (lambda r: phases.ask(PAIRED, [A, B, C], ["h:1"]), "backup"),
        (lambda r: phases.ask(r, [A, B, C], ["h:1", "h:2", "h:3"]), "without hot standby"),
        (lambda r: phases.ask(PAIRED, [A, B, C], [A, "h:2", "h:3"]), "more than once"),
    ],
)
def test_a_bad_ask_is_refused(transition, message):
    with pytest.raises(LayoutChangeRefused, match=message):
        transition(NOW)


# The layout a role starts in: (the record, the role's pservers, its endpoint (None: a trainer), decision).
GROWING = dataclasses.replace(NOW, change=LayoutChange(4, [A, B, C]))
GROWN = LayoutRecord(4, [A, B, C], history=[[A, B]])
SHRUNK = LayoutRecord(5, [A, B], history=[[A, B], [A, B, C]])


@pytest.mark.parametrize(
    "record, pservers, endpoint, decision",
    [
        (None, [A, B], A, starting.NEW),  # a new job: its pservers record it
        (NOW, [A, B], A, starting.FOLLOW),
        (NOW, [A, B], None, starting.FOLLOW),
        (GROWING, [A, B, C], C, starting.WAIT),  # the new pserver, started once asked
        (GROWING, [A, B, C], A, starting.FOLLOW),
        (GROWING, [A, B, C], None, starting.FOLLOW),  # a trainer: told "moved" once the change commits
        (GROWN, [A, B], A, starting.FOLLOW),  # started again with its first command: the layout now
        (GROWN, [A, B], None, starting.FOLLOW),
        (GROWN, [A, B, C], C, starting.FOLLOW),
        (SHRUNK, [A, B, C], C, starting.LEFT),  # removed: it has left the job
        (SHRUNK, [A, B, C], None, starting.FOLLOW),
        (NOW, [A, B, C], A, starting.NEW),  # the job started again on another list: its pservers record it
        (NOW, [A, B, C], C, starting.NEW),
        (NOW, ["127.0.0.1:9"], "127.0.0.1:9", starting.NEW),  # ... on other hosts altogether
        (NOW, [A, B, C], None, starting.NEW),  # a trainer: its own plan
    ],
)
def test_a_role_starts_in_the_layout_its_job_runs(record, pservers, endpoint, decision):
    assert starting.start_in(record, pservers, endpoint) == decision


# Hot standby: a shard's backup is in a layout as its pserver is (X, Y, Z back up A, B, C).
X, Y, Z = "127.0.0.1:7011", "127.0.0.1:7012", "127.0.0.1:7013"
PAIRS = dataclasses.replace(NOW, replicas=[X, Y])


def changing(record: LayoutRecord, phase: str) -> LayoutRecord:
    """``record`` growing to A, B, C (backed up by X, Y, Z), in ``phase``."""
    return dataclasses.replace(record, change=LayoutChange(4, [A, B, C], [X, Y, Z], phase))


@pytest.mark.parametrize(
    "record, pservers, endpoint, decision",
    [
        (PAIRS, [A, B], X, starting.FOLLOW),
        (
            dataclasses.replace(PAIRS, change=LayoutChange(4, [A, B, C], [X, Y, Z])),
            [A, B, C],
            Z,
            starting.WAIT,
        ),
        (LayoutRecord(4, [A, B, C], [X, Y, Z], history=[[A, B]]), [A, B], Y, starting.FOLLOW),
        (LayoutRecord(5, [A, B], [X, Y], history=[[A, B], [A, B, C]]), [A, B, C], Z, starting.LEFT),
    ],
)
def test_a_backup_starts_in_the_layout_its_job_runs(record, pservers, endpoint, decision):
    assert starting.start_in(record, pservers, endpoint) == decision


@pytest.mark.parametrize(
    "record, decision",
    [
        (None, phases.GO_ON),
        (PAIRS, phases.GO_ON),
        (dataclasses.replace(PAIRS, change=LayoutChange(4, [A, B, C], [X, Y, Z], "asked")), phases.GO_ON),
        (
            dataclasses.replace(PAIRS, change=LayoutChange(4, [A, B, C], [X, Y, Z], "switching")),
            phases.ROLL_BACK,
        ),
        (dataclasses.replace(PAIRS, change=LayoutChange(4, [C], [Z], "switching")), phases.ROLL_BACK),
        (LayoutRecord(4, [A, B, C], [X, Y, Z]), phases.MOVED),  # committed while it was the backup
        (
            dataclasses.replace(NOW, pservers=[B, C], change=LayoutChange(4, [B], [], "switching")),
            phases.GO_ON,
        ),
    ],
)
def test_a_backup_taking_the_lead_mid_change_rolls_it_back_or_answers_moved(record, decision):
    assert phases.on_new_primary(record, 3, A) == decision


@pytest.mark.parametrize("replicas", [(), ("h:4", "h:5")])
def test_a_moved_answer_names_the_layout_and_its_backups(replicas):
    text = "pserver h:1: layout epoch 2 ended; " + moved_message(3, ["h:1", "h:2"], replicas)
    assert moved_to(text) == (3, ["h:1", "h:2"], list(replicas) or None)
    assert moved_to("pserver h:1: shutting down") is None


@pytest.mark.parametrize(
    "prefix, epoch, keys",
    [(None, 0, "/torch-pserver/d1"), ("/job7/", 0, "/job7"), ("/job7", 2, "/job7/layout-2")],
)
def test_each_layout_has_its_own_shard_keys(prefix, epoch, keys):
    config = types.SimpleNamespace(coordinator_prefix=prefix)
    assert shards_prefix(types.SimpleNamespace(config=config, layout_digest="d1", layout_epoch=epoch)) == keys


@pytest.mark.parametrize("endpoint, decision", [(C, starting.WAIT), (A, starting.WAIT), (None, starting.NEW)])
def test_a_pserver_on_a_new_list_waits_while_the_recorded_pservers_serve(endpoint, decision):
    """Started before its change was asked, or after it was rolled back: the job runs, so it never overwrites
    the record; it waits for a change that adds it."""
    assert starting.start_in(NOW, [A, B, C], endpoint, recorded_serving=True) == decision


def test_a_role_on_a_list_the_job_never_had_is_refused_during_a_change():
    with pytest.raises(LayoutChangeRefused, match="is changing its pserver count"):
        starting.start_in(GROWING, ["127.0.0.1:9"], None)


def test_rolling_back_leaves_the_current_layout():
    r = phases.roll_back(phases.schedule_switch(phases.ask(NOW, [A, B, C]), 9), "C died")
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


def test_ps_reshard_starts_without_importing_torch():
    """The record, its phases and the checks load without torch: ``ps-reshard`` starts at once."""
    code = "import sys, pserver.layout.reshard_cli; print(sorted(m for m in sys.modules if m == 'torch'))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
