"""SharedLoad: a worker's endpoints bound to table rows, the whole gateway's load summed back.

Two workers' views of one table in one process (each with its own registry and endpoint
objects, as real workers have); the cross-process behaviour is in tests/web/test_workers_shared_view.py.
"""

from __future__ import annotations

import random
import time

from gateway.fleet.dp import set_ranks
from gateway.fleet.endpoint import Endpoint
from gateway.fleet.registry import EndpointRegistry
from gateway.fleet.shared_load import SharedLoad
from gateway.fleet.worker_table import WorkerTable, create_table


def _worker(
    spec, index: int, urls: list[str], full: list[str] | None = None
) -> tuple[SharedLoad, EndpointRegistry]:
    registry = EndpointRegistry(Endpoint(url) for url in urls)
    shared = SharedLoad(WorkerTable(spec, index), registry, on_full=None if full is None else full.append)
    shared.refresh(force=True)
    return shared, registry


def test_each_worker_sees_its_own_sends_at_once_and_the_siblings_at_refresh(tmp_path):
    spec = create_table(str(tmp_path), rows=4, workers=2)
    first, reg0 = _worker(spec, 0, ["http://a:1"])
    second, reg1 = _worker(spec, 1, ["http://a:1"])
    a0, a1 = reg0.get("http://a:1"), reg1.get("http://a:1")
    a0.in_flight += 1  # what InFlightHook does
    a0.shared_load.add(1, 500)
    a0.pending_prefill_tokens += 400.0
    a0.shared_load.add_pending(400.0)
    assert (a1.in_flight, a1.in_flight_tokens) == (0, 0)
    second.refresh(force=True)
    assert (a1.in_flight, a1.in_flight_tokens, a1.pending_prefill_tokens) == (1, 500, 400.0)
    a1.shared_load.add(2, 100)
    first.refresh(force=True)
    assert (a0.in_flight, a0.in_flight_tokens) == (3, 600)


def test_a_full_table_keeps_the_endpoint_local_and_counts_it_until_a_row_frees(tmp_path):
    spec = create_table(str(tmp_path), rows=1, workers=2)
    full: list[str] = []
    shared, registry = _worker(spec, 0, ["http://a:1", "http://b:2"], full)
    a, b = registry.get("http://a:1"), registry.get("http://b:2")
    assert a.shared_load is not None and b.shared_load is None
    assert full == ["b:2"]
    registry.remove("http://a:1")  # its row is freed at the next refresh; b takes it
    shared.refresh()
    assert a.shared_load is None and b.shared_load is not None
    assert shared.table.rows_in_use() == 1


def test_a_replaced_endpoint_object_shares_its_names_row(tmp_path):
    spec = create_table(str(tmp_path), rows=2, workers=2)
    shared, registry = _worker(spec, 0, ["http://a:1"])
    old = registry.get("http://a:1")
    old.shared_load.add(1, 10)  # a request still running on the object being replaced
    registry.remove("http://a:1", rebuild=False)
    registry.add(Endpoint("http://a:1"))
    shared.refresh(force=True)
    new = registry.get("http://a:1")
    assert new.shared_load is old.shared_load and new.in_flight == 1


def test_a_refresh_sums_only_changed_rows_and_never_misses_a_change(tmp_path):
    """The refresh compares the table with its last copy: rows nobody wrote keep their fields
    (the last sum plus this worker's own changes); any written row, by any worker, is re-summed.
    Random sends and ends by both workers, with 1 to ~60 of them between refreshes (from one
    row changed to all twelve): every refreshed view equals the sums."""
    urls = [f"http://r{i}:1" for i in range(12)]
    spec = create_table(str(tmp_path), rows=16, workers=2)
    workers = [_worker(spec, 0, urls), _worker(spec, 1, urls)]
    running: list[list[int]] = [[0] * len(urls), [0] * len(urls)]  # per worker, per endpoint
    rng = random.Random(7)
    for _ in range(5000):
        w = rng.randrange(2)
        shared, registry = workers[w]
        i = rng.randrange(len(urls))
        endpoint = registry.get(urls[i])
        if rng.random() < 0.06:
            shared.refresh(force=True)
            for j, url in enumerate(urls):
                mine = registry.get(url)
                assert mine.in_flight == running[0][j] + running[1][j], (j, running)
                assert mine.in_flight_tokens == 10 * mine.in_flight
        elif running[w][i] and rng.random() < 0.5:  # a request ends (InFlightHook.on_done)
            running[w][i] -= 1
            endpoint.in_flight -= 1
            endpoint.shared_load.add(-1, -10)
        else:  # a request is sent
            running[w][i] += 1
            endpoint.in_flight += 1
            endpoint.shared_load.add(1, 10)


def _send(endpoint: Endpoint, n: int = 1) -> None:  # InFlightHook.on_send
    endpoint.in_flight += n
    endpoint.in_flight_tokens += 10 * n
    if endpoint.shared_load is not None:
        endpoint.shared_load.add(n, 10 * n)


def _done(endpoint: Endpoint) -> None:  # InFlightHook.on_done
    endpoint.in_flight -= 1
    endpoint.in_flight_tokens -= 10
    if endpoint.shared_load is not None:
        endpoint.shared_load.add(-1, -10)


def test_a_count_the_cells_floor_swallowed_is_healed_by_the_next_full_sum(tmp_path):
    """A data-parallel replica stops being a target (its ranks learned: unbound) and becomes one
    again (unhealthy: ranks dropped) while one of its requests runs. That request's end changes
    the field but not its cell (floored at zero): no byte changed, so only the periodic sum of
    every row (50 ms) puts the field back to the table's sum (found by review)."""
    spec = create_table(str(tmp_path), rows=8, workers=2)
    regs = [EndpointRegistry([Endpoint("http://x:1", healthy=True)]) for _ in range(2)]
    loads = [SharedLoad(WorkerTable(spec, w), regs[w]) for w in range(2)]
    for shared in loads:
        shared.refresh(force=True)
    x0, x1 = regs[0].get("http://x:1"), regs[1].get("http://x:1")
    _send(x0)
    _send(x1, 2)
    set_ranks(x0, [0, 1])  # worker 0 learns two ranks: they route instead of the replica
    regs[0].rebuild()
    loads[0].refresh(force=True)
    assert x0.shared_load is None
    x0.healthy = False  # ranks dropped: the replica is a target again
    regs[0].rebuild()
    loads[0].refresh(force=True)
    assert x0.in_flight == 2  # worker 1's two; worker 0's running one is no longer in the table
    _done(x0)  # field 2 → 1, its cell stays at 0
    time.sleep(0.06)
    loads[0].refresh(force=True)
    assert x0.in_flight == 2  # worker 1 still runs two


def test_a_replaced_object_gets_the_sum_even_when_no_row_changed(tmp_path):
    """A reload replaces the endpoint object while a sibling's requests run there and nothing is
    written to the row between two refreshes: the new object still gets the row's sum."""
    spec = create_table(str(tmp_path), rows=4, workers=2)
    regs = [EndpointRegistry([Endpoint("http://a:1", healthy=True)]) for _ in range(2)]
    loads = [SharedLoad(WorkerTable(spec, w), regs[w]) for w in range(2)]
    for shared in loads:
        shared.refresh(force=True)
    _send(regs[1].get("http://a:1"), 3)
    loads[0].refresh(force=True)
    regs[0].remove("http://a:1", rebuild=False)
    regs[0].add(Endpoint("http://a:1", healthy=True))
    loads[0].refresh(force=True)
    assert regs[0].get("http://a:1").in_flight == 3


def test_changed_rows_finds_exactly_the_rows_that_differ():
    """The bisection against the plain answer, for random tables and random changes."""
    from gateway.fleet.shared_load import _changed_rows

    rng = random.Random(11)
    for _ in range(500):
        rows, row_bytes = rng.randint(1, 70), 8 * rng.choice((3, 6, 24))
        last = bytes(rng.getrandbits(8) for _ in range(rows * row_bytes))
        changed = bytearray(last)
        for row in rng.sample(range(rows), rng.randint(0, rows)):
            changed[row * row_bytes + rng.randrange(row_bytes)] ^= 1 << rng.randrange(8)
        spans = [(r * row_bytes, (r + 1) * row_bytes) for r in range(rows)]
        expected = [r for r, (a, b) in enumerate(spans) if changed[a:b] != last[a:b]]
        assert list(_changed_rows(bytes(changed), last, row_bytes)) == expected
