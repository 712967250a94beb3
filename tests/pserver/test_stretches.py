"""Where parked calls' stretches run (pserver/rpc/stretches.py, pserver/rpc/aio.py).

The decision is a pure function of the pserver's program: on the event loop
only where nothing in a stretch can block. With stretches on the loop, a sync
step's last push releases every parked call under the engine's lock; each
released call's next stretch is queued to the loop, never run inside the
releasing one, and the step applies once. SaveTables, which holds the
engine's lock across its writes, first moves the stretches off the loop.
"""

import asyncio
import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from pserver.engine.waits import Waits
from pserver.rpc.aio import Parking
from pserver.rpc.parking import park
from pserver.rpc.stretches import Stretches, stretch_place, what_blocks
from tests.helpers.polling import poll
from tests.helpers.table_models import table_program
from transpiler import DistributeTranspiler, DistributeTranspilerConfig, TableLifecycle

EP = "127.0.0.1:1"


def program(tables_ram_rows=0, sync_mode=True, **config):
    """A pserver program of a two-table model, with ``config`` and every table's ``ram_rows``."""
    t = DistributeTranspiler(DistributeTranspilerConfig(**config))
    t.transpile(0, program=table_program("sgd", lr=0.1), pservers=EP, trainers=2, sync_mode=sync_mode)
    ps = t.get_pserver_program(EP)
    tables = [dataclasses.replace(s, lifecycle=TableLifecycle(ram_rows=tables_ram_rows)) for s in ps.tables]
    return dataclasses.replace(ps, tables=tables)


REPLICAS = dict(server_replicas=2, replica_endpoints="127.0.0.1:2", coordinator="http://127.0.0.1:3")

# (config and ram_rows, on the loop, what the reason names)
CASES = [
    (dict(), True, "nothing in them blocks"),
    (dict(pserver_stretches_on_loop=False), False, "pserver_stretches_on_loop=False"),
    (dict(checkpoint_dir="/ckpt"), False, "checkpoint_dir"),
    (dict(checkpoint_dir="/ckpt", checkpoint_every=5), False, "checkpoint_dir"),
    (dict(export_dir="/exp", export_every=3), False, "export_every"),
    (dict(export_dir="/exp", export_every_seconds=60.0), False, "export_every"),
    (dict(export_dir="/exp"), True, "nothing in them blocks"),  # a directory, no schedule: no export
    (dict(table_disk_dir="/disk"), True, "nothing in them blocks"),  # no table with ram_rows: no disk tier
    (dict(tables_ram_rows=100), False, "disk tier"),
    (dict(tables_ram_rows=100, table_disk_dir="/disk"), False, "disk tier"),
    (REPLICAS, False, "server_replicas=2"),
    (dict(max_staleness=2, heartbeat_interval=5.0), True, "nothing in them blocks"),
    (dict(sync_mode=False), False, "asynchronous training"),
    (dict(sync_mode=False, pserver_stretches_on_loop=False), False, "pserver_stretches_on_loop=False"),
]


@pytest.mark.parametrize("settings,on_loop,why", CASES)
def test_stretches_run_on_the_loop_only_where_nothing_in_them_blocks(settings, on_loop, why):
    place = stretch_place(program(**settings))
    assert place[0] is on_loop and why in place[1], place


def test_every_blocking_piece_is_named_at_once():
    found = what_blocks(
        program(tables_ram_rows=10, checkpoint_dir="/c", export_dir="/e", export_every=1, **REPLICAS)
    )
    assert len(found) == 4, found
    assert (
        stretch_place(program(tables_ram_rows=10, pserver_stretches_on_loop=False))[1]
        == "pserver_stretches_on_loop=False"
    )


def test_a_non_bool_switch_is_refused():
    with pytest.raises(ValueError, match="pserver_stretches_on_loop must be a bool"):
        DistributeTranspilerConfig(pserver_stretches_on_loop="yes")


K = 6


@pytest.mark.timeout(60)
@pytest.mark.parametrize("on_loop", [True, False])
def test_a_step_releases_every_parked_call_once_and_no_stretch_runs_inside_another(on_loop):
    """K calls park on one step; the last applies it under the lock and releases the others, each resumed
    once."""
    cv = threading.Condition()
    waits = Waits(cv, EP, barrier_timeout=30.0)
    state = dict(arrived=0, applied=0, deepest=0, threads=set(), resumed=[])
    depth = {}  # stretches running now, by thread: 2 would be a stretch inside another

    def stretch(record):
        me = threading.get_ident()
        depth[me] = depth.get(me, 0) + 1
        state["deepest"] = max(state["deepest"], depth[me])
        state["threads"].add(me)
        try:
            record()
        finally:
            depth[me] -= 1

    def call(i):
        handle = None

        def arrive():
            nonlocal handle
            with cv:
                state["arrived"] += 1
                if state["arrived"] == K:  # the last push applies the step and ends every wait
                    state["applied"] += 1
                    waits.notify()
                handle = waits.park(lambda: state["applied"] == 1, "step 0", lambda: [], trainer=i)

        stretch(arrive)
        yield from park(handle)
        stretch(lambda: state["resumed"].append(i))
        yield f"answer {i}"

    stretches = Stretches(on_loop)
    with ThreadPoolExecutor(2, thread_name_prefix="pool") as pool:
        parking = Parking(pool, stretches)

        async def main():
            stretches.bind(asyncio.get_running_loop())
            state["loop"] = threading.get_ident()

            async def collect(i):
                return [a async for a in parking.drive(call(i))]

            return await asyncio.wait_for(asyncio.gather(*(collect(i) for i in range(K))), 30)

        answers = asyncio.run(main())

    assert answers == [[f"answer {i}"] for i in range(K)]
    assert state["applied"] == 1 and sorted(state["resumed"]) == list(range(K)) and waits.parked == 0
    assert state["deepest"] == 1
    if on_loop:
        assert state["threads"] == {state["loop"]}
    else:
        assert state["loop"] not in state["threads"]


@pytest.mark.timeout(30)
def test_a_call_holding_the_lock_across_io_waits_for_the_loops_stretch_and_keeps_later_ones_off_the_loop():
    stretches = Stretches(True)
    loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever, daemon=True)
    loop_thread.start()
    order = []
    started, release = threading.Event(), threading.Event()
    try:
        loop.call_soon_threadsafe(stretches.bind, loop)

        def long_stretch():  # a stretch running on the loop when SaveTables comes
            started.set()
            release.wait(20)
            order.append("stretch ended")

        loop.call_soon_threadsafe(long_stretch)
        assert started.wait(10)

        def save():
            with stretches.off_loop():
                order.append(("io began", stretches.on_loop()))

        saver = threading.Thread(target=save)
        saver.start()
        poll(lambda: not stretches.on_loop(), "stretches moved off the loop")
        assert order == []  # the save waits for the loop's stretch
        release.set()
        saver.join(20)
        assert order == ["stretch ended", ("io began", False)]
        assert stretches.on_loop()  # back on the loop once the save is done
    finally:
        release.set()
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join(10)
        loop.close()


def test_without_a_loop_or_where_not_allowed_off_loop_changes_nothing():
    for stretches in (Stretches(True), Stretches(False)):
        with stretches.off_loop():
            assert stretches.on_loop() is stretches.allowed


@pytest.mark.timeout(30)
def test_a_call_started_after_the_pool_shut_down_ends_with_the_error_instead_of_hanging():
    pool = ThreadPoolExecutor(1)
    pool.shutdown()

    async def main():
        return [a async for a in Parking(pool, Stretches(False)).drive(x for x in ["never"])]

    with pytest.raises(RuntimeError, match="shutdown"):
        asyncio.run(asyncio.wait_for(main(), 10))
