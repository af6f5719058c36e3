"""Breaker states shared by two workers: two processes' views of one table, in one test process.

Each "worker" has its own registry, endpoint objects and breakers, as real workers do, and
maps the same table file with its own column; ``review`` is what each worker's ticker runs.
"""

from __future__ import annotations

import time

from gateway.config import ResilienceConfig
from gateway.fleet.endpoint import Endpoint
from gateway.fleet.registry import EndpointRegistry
from gateway.fleet.shared_load import SharedLoad
from gateway.fleet.worker_table import WorkerTable, create_table
from gateway.ops.metrics import GatewayMetrics
from gateway.proxy.resilience import BreakerState, CircuitBreakers
from gateway.proxy.shared_breakers import SharedBreakerStates

URLS = ["http://127.0.0.1:9101", "http://127.0.0.1:9102", "http://127.0.0.1:9103"]


def _worker(spec, index: int) -> tuple[CircuitBreakers, Endpoint]:
    endpoints = [Endpoint(url, configured_models=frozenset({"m"}), healthy=True) for url in URLS]
    registry = EndpointRegistry(endpoints)
    shared = SharedLoad(WorkerTable(spec, index), registry)
    shared.refresh(force=True)
    breakers = CircuitBreakers(
        ResilienceConfig(consecutive_failures=2, ejection_s=5.0), registry, GatewayMetrics()
    )
    breakers.shared = SharedBreakerStates(shared)
    return breakers, endpoints[0]


def _ejected_by_first(tmp_path):
    """Two workers' views; the first worker ejects the endpoint (5 s), the second adopts it."""
    spec = create_table(str(tmp_path), rows=8, workers=2)
    (first, a0), (second, a1) = _worker(spec, 0), _worker(spec, 1)
    first.on_failure(a0, "http_500")
    first.on_failure(a0, "http_500")
    second.review(time.monotonic())
    return first, a0, second, a1


def test_an_ejection_is_adopted_one_worker_probes_and_its_verdict_closes_both(tmp_path):
    spec = create_table(str(tmp_path), rows=8, workers=2)
    (first, a0), (second, a1) = _worker(spec, 0), _worker(spec, 1)
    first.on_failure(a0, "http_500")
    first.on_failure(a0, "http_500")
    assert a0.ejected and not a1.ejected
    now = time.monotonic()
    second.review(now)
    assert a1.ejected and second.state(a1) is BreakerState.OPEN  # adopted, never having failed there

    later = now + 6.0  # the ejection is over: both review; only the first to claim probes
    second.review(later)
    first.review(later)
    assert second.state(a1) is BreakerState.HALF_OPEN and not a1.ejected  # in rotation for its probe
    assert first.state(a0) is BreakerState.OPEN and a0.ejected  # waits for the sibling's verdict

    second.on_send(a1)
    second.on_success(a1)
    first.review(later + 0.25)
    assert first.state(a0) is BreakerState.CLOSED and not a0.ejected


def test_a_failed_probe_ejects_again_everywhere_for_longer(tmp_path):
    spec = create_table(str(tmp_path), rows=8, workers=2)
    (first, a0), (second, a1) = _worker(spec, 0), _worker(spec, 1)
    first.on_failure(a0, "connect")
    first.on_failure(a0, "connect")
    now = time.monotonic() + 6.0
    first.review(now)  # first claims the probe
    second.review(now)
    first.on_send(a0)
    first.on_failure(a0, "connect")  # the probe failed: ejected again, for 10 s from the real now
    second.review(now + 0.25)
    assert second.state(a1) is BreakerState.OPEN and a1.ejected
    second.review(now + 3.0)  # 9 s after the first ejection (5 s), within the second (10 s from now)
    assert second.state(a1) is BreakerState.OPEN and a1.ejected


def test_a_claim_its_worker_never_uses_lapses_and_a_sibling_with_traffic_probes(tmp_path):
    """The claim used to stand until its worker sent the probe: a worker with no traffic for the
    replica (every client on the sibling's connections) held it out of rotation for good."""
    first, a0, second, a1 = _ejected_by_first(tmp_path)
    now = time.monotonic() + 6.0  # the 5 s ejection is over
    first.review(now)  # first claims the probe, and then gets no request for this replica
    second.review(now)
    second.review(now + 0.5)
    assert second.state(a1) is BreakerState.OPEN and a1.ejected  # the claim is fresh: wait for it
    first.review(now + 0.5)  # no probe in flight: the claim is not renewed

    second.review(now + 1.5)  # lapsed (lease 1 s): second takes it and has the replica in rotation
    assert second.state(a1) is BreakerState.HALF_OPEN and not a1.ejected
    first.review(now + 1.6)  # first's claim is gone: out, waiting for second's verdict
    assert first.state(a0) is BreakerState.OPEN and a0.ejected

    second.on_send(a1)  # second's probe, a long stream: its worker renews the claim while it runs
    for step in range(1, 6):
        second.review(now + 1.6 + step * 0.5)
        first.review(now + 1.8 + step * 0.5)
        assert first.state(a0) is BreakerState.OPEN and a0.ejected, step  # never a second probe
    second.on_success(a1)
    first.review(now + 5.0)
    assert first.state(a0) is BreakerState.CLOSED and not a0.ejected


def test_a_worker_whose_claim_lapsed_sends_no_second_probe_and_waits_for_the_verdict(tmp_path):
    first, a0, second, a1 = _ejected_by_first(tmp_path)
    now = time.monotonic() + 6.0
    first.review(now)  # first claims, sends nothing
    second.review(now + 1.5)  # lapsed: second claims and probes
    second.on_send(a1)
    first.on_send(a0)  # a request reaches first before its next review: not a second probe
    assert first.state(a0) is BreakerState.OPEN and a0.ejected
    first.on_success(a0)  # its answer decides nothing: the verdict is second's
    assert first.state(a0) is BreakerState.OPEN
    second.on_failure(a1, "http_500")  # second's probe failed: ejected again, everywhere
    first.review(now + 2.0)
    assert first.state(a0) is BreakerState.OPEN and a0.ejected


def test_an_endpoint_that_left_and_came_back_is_adopted_again(tmp_path):
    """A returning endpoint's row starts over at version 0: a worker that remembered the version
    it had acted on before the endpoint left saw the new ejection (version 1 again) as seen."""
    spec = create_table(str(tmp_path), rows=8, workers=2)
    workers = []
    for index in range(2):
        registry = EndpointRegistry(
            [Endpoint(url, configured_models=frozenset({"m"}), healthy=True) for url in URLS]
        )
        shared = SharedLoad(WorkerTable(spec, index), registry)
        shared.refresh(force=True)
        breakers = CircuitBreakers(
            ResilienceConfig(consecutive_failures=2, ejection_s=5.0), registry, GatewayMetrics()
        )
        breakers.shared = SharedBreakerStates(shared)
        workers.append((registry, shared, breakers))

    def eject_on_first_and_review() -> tuple[Endpoint, Endpoint]:
        (_, _, first), (second_registry, _, second) = workers
        a0 = workers[0][0].get(URLS[0])
        a1 = second_registry.get(URLS[0])
        assert a0 is not None and a1 is not None
        first.on_failure(a0, "http_500")
        first.on_failure(a0, "http_500")
        second.review(time.monotonic())
        return a0, a1

    _, a1 = eject_on_first_and_review()
    assert a1.ejected
    for registry, shared, breakers in workers:  # it leaves every worker: its row is freed
        registry.remove(URLS[0])
        breakers.forget(URLS[0])
        shared.refresh(force=True)
    for registry, shared, _ in workers:  # and comes back
        registry.add(Endpoint(URLS[0], configured_models=frozenset({"m"}), healthy=True))
        shared.refresh(force=True)
    _, a1 = eject_on_first_and_review()
    assert a1.ejected and workers[1][2].state(a1) is BreakerState.OPEN
