"""The shared worker table: real processes writing their own cells at once, rows claimed and freed.

Each writer process maps the table the way a gateway worker does (spawned, not forked)
and hammers its own load cells while the other does the same on the same row; no update
may be lost and no process may see another's column as its own.
"""

from __future__ import annotations

import multiprocessing

import pytest

from gateway.fleet.worker_table import TableSpec, WorkerTable, create_table

ROUNDS = 20_000


def _hammer(spec: TableSpec, worker: int, names: list[str], start: multiprocessing.Event) -> None:
    table = WorkerTable(spec, worker)
    cells = [table.load_cell(table.claim(name)) for name in names]
    start.wait(10)
    for i in range(ROUNDS):
        for cell in cells:
            cell.add(1, 10)
            cell.add_pending(2.5)
            if i % 2:  # every second request ends: ROUNDS // 2 stay in flight per worker
                cell.add(-1, -10)
                cell.add_pending(-5.0)
    table.close()


@pytest.fixture
def spec(tmp_path) -> TableSpec:
    return create_table(str(tmp_path), rows=8, workers=3)


def test_concurrent_writers_in_real_processes_lose_no_update(spec):
    context = multiprocessing.get_context("spawn")
    start = context.Event()
    names = ["a:1", "b:2", "c:3"]
    procs = [context.Process(target=_hammer, args=(spec, w, names, start)) for w in range(3)]
    for proc in procs:
        proc.start()
    start.set()
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    parent = WorkerTable(spec, 0)
    for name in names:
        row = parent.claim(name)  # the same name: the same row, already claimed by all three
        assert parent.row_load(row) == (3 * ROUNDS // 2, 3 * 10 * ROUNDS // 2, 0.0)
    assert parent.rows_in_use() == 3
    parent.close()


def test_rows_are_per_name_bounded_and_freed_when_no_worker_uses_them(spec):
    first, second = WorkerTable(spec, 0), WorkerTable(spec, 1)
    row = first.claim("replica:8000")
    assert second.claim("replica:8000") == row
    rows = {first.claim(f"other:{i}") for i in range(7)}
    assert row not in rows and len(rows) == 7
    assert first.claim("one-too-many:1") is None  # full: the caller keeps it local
    first.load_cell(row).add(3, 30)
    second.load_cell(row).add(2, 20)
    assert first.row_load(row) == (5, 50, 0)
    first.release(row)  # first's counts go; second still uses the row
    assert second.row_load(row) == (2, 20, 0)
    assert first.claim("one-too-many:1") is None
    second.release(row)
    fresh = first.claim("one-too-many:1")  # free once nobody uses it, and zeroed
    assert fresh == row
    assert first.row_load(fresh) == (0, 0, 0)


def test_a_dead_workers_column_and_probe_are_cleared_by_the_parent(spec):
    worker, sibling, parent = WorkerTable(spec, 0), WorkerTable(spec, 1), WorkerTable(spec, None)
    row = worker.claim("replica:8000")
    sibling.claim("replica:8000")
    only_dead = worker.claim("gone:1")
    worker.load_cell(row).add(4, 400)
    sibling.load_cell(row).add(1, 100)
    worker.write_breaker(row, 123.0, 2, None)
    assert worker.claim_probe(row, 130.0, lease_s=60.0)
    assert not sibling.claim_probe(row, 131.0, lease_s=60.0)  # one probe for the whole gateway
    parent.clear_worker(0)
    assert parent.row_load(row) == (1, 100, 0)
    breaker = parent.breaker(row)
    assert (breaker.open_until, breaker.ejections_in_row, breaker.probe_owner) == (130.0, 2, None)
    assert sibling.claim_probe(row, 131.0, lease_s=60.0)  # the probe is the sibling's to send now
    assert parent.rows_in_use() == 1  # the row only the dead worker used is free
    assert only_dead != row


def test_a_worker_outside_the_table_is_refused():
    with pytest.raises(ValueError):
        WorkerTable(TableSpec("/nonexistent", 1, 2), 2)


def test_heartbeats_are_per_worker_outside_the_rows_and_cleared_with_the_worker(spec):
    worker, sibling, parent = WorkerTable(spec, 0), WorkerTable(spec, 2), WorkerTable(spec, None)
    row = worker.claim("replica:8000")
    worker.load_cell(row).add(3, 300)
    worker.beat(1234.5)
    sibling.beat(99.0)
    assert (parent.last_beat(0), parent.last_beat(1), parent.last_beat(2)) == (1234.5, 0.0, 99.0)
    assert parent.row_load(row) == (3, 300, 0)  # the beat cells overlap no load cell
    last = spec.rows - 1
    worker.write_breaker(last, 5.0, 7, None)  # the cells just before the beats
    assert parent.last_beat(0) == 1234.5 and parent.breaker(last).ejections_in_row == 7
    parent.clear_worker(0)
    assert (parent.last_beat(0), parent.last_beat(2)) == (0.0, 99.0)  # a replacement starts silent
    with pytest.raises(RuntimeError):
        parent.beat(1.0)  # the parent has no cell of its own


def test_a_probe_claim_is_a_lease_its_owner_keeps_while_the_probe_runs(spec):
    worker, sibling = WorkerTable(spec, 0), WorkerTable(spec, 1)
    row = worker.claim("replica:8000")
    sibling.claim("replica:8000")
    assert worker.claim_probe(row, 100.0, lease_s=1.0)
    assert not sibling.claim_probe(row, 100.9, lease_s=1.0)
    assert worker.keep_probe(row, 100.8)  # its probe is in flight
    assert not sibling.claim_probe(row, 101.7, lease_s=1.0)
    assert sibling.claim_probe(row, 101.9, lease_s=1.0)  # not kept for a lease: it lapsed
    assert sibling.holds_probe(row) and not worker.holds_probe(row)
    assert not worker.keep_probe(row, 102.0)  # no longer its own to keep
    assert not worker.claim_probe(row, 102.0, lease_s=1.0)
