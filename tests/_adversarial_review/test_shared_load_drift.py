"""Adversarial review of 10b92f8: "a row whose bytes are unchanged has correct fields".

LoadCell clamps at zero; the Endpoint fields do not. When this worker's own decrement is
larger than what its cell holds, the field moves but the row's bytes do not, so the new
refresh never re-sums that row and the field stays wrong (possibly negative) until some
worker writes that row again. The refresh before 10b92f8 re-summed every bound row and
healed it at once.

Reachable path: a data-parallel vLLM replica (ranks learned from its scrape) whose replica
object is a routing target, stops being one (ranks learned: unbound, own cells dropped) and
becomes one again (replica unhealthy: ranks dropped) while a request sent to it is still
running. The re-bound object is not in ``_unshared``, so its running count is not folded
into the new cell; the request's end then clamps at zero in the cell.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.fleet.dp import set_ranks
from gateway.fleet.endpoint import Endpoint
from gateway.fleet.registry import EndpointRegistry
from gateway.fleet.shared_load import SharedLoad
from gateway.fleet.worker_table import WorkerTable, create_table

ROOT = Path(__file__).resolve().parents[2]


def _parent_shared_load():
    """gateway/fleet/shared_load.py as of 10b92f8^ (read with `git show`, nothing changed)."""
    text = subprocess.run(
        ["git", "-C", str(ROOT), "show", "10b92f8^:gateway/fleet/shared_load.py"],
        check=True, capture_output=True, text=True,
    ).stdout
    spec = importlib.util.spec_from_loader("_parent_shared_load", loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules["_parent_shared_load"] = module
    exec(compile(text, "parent_shared_load.py", "exec"), module.__dict__)
    return module.SharedLoad


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


@pytest.mark.parametrize("impl", ["HEAD", "parent"])
def test_a_rebound_replica_whose_request_ends_keeps_a_wrong_count(tmp_path, impl):
    cls = SharedLoad if impl == "HEAD" else _parent_shared_load()
    spec = create_table(str(tmp_path), rows=8, workers=2)
    regs = [EndpointRegistry([Endpoint("http://x:1", healthy=True)]) for _ in range(2)]
    loads = [cls(WorkerTable(spec, w), regs[w]) for w in range(2)]
    for shared in loads:
        shared.refresh(force=True)
    x0, x1 = regs[0].get("http://x:1"), regs[1].get("http://x:1")
    _send(x0)  # worker 0: one request on the replica, before its first scrape
    _send(x1, 2)  # worker 1: two requests there (worker 1 has not scraped yet: x1 still a target)

    set_ranks(x0, [0, 1])  # worker 0's scrape finds two DP ranks: the ranks route instead
    regs[0].rebuild()
    loads[0].refresh(force=True)
    assert x0.shared_load is None  # unbound; worker 0's cells in the row dropped

    x0.healthy = False  # its health check fails: learned ranks dropped, the replica is a target again
    regs[0].rebuild()
    loads[0].refresh(force=True)
    assert x0.shared_load is not None
    assert x0.in_flight == 2  # the sum: worker 1's two (worker 0's running one is no longer counted)

    _done(x0)  # worker 0's old request ends: field 2 -> 1, its cell clamps at 0 (row bytes unchanged)
    loads[0].refresh(force=True)
    truth = 2  # worker 1 still has two running; worker 0 none
    assert x0.in_flight == truth, f"{impl}: field {x0.in_flight}, table sums {truth}"
