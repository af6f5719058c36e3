"""The per-endpoint pool queue: counted by the upstream client, exported, and seen as queued."""

from __future__ import annotations

import asyncio
import contextlib

from prometheus_client import generate_latest

from gateway.admission.saturation import SaturationDetector
from gateway.config import AdmissionConfig
from gateway.fleet.endpoint import Endpoint
from gateway.ops.metrics import GatewayMetrics
from tests.proxy.test_upstream_client import Conn, fixed, make_client, serve, within
from tests.support.harness import wait_until

__all__ = ["make_client", "serve"]  # fixtures


async def test_requests_waiting_for_a_slot_are_counted_and_uncounted(serve, make_client):
    go = asyncio.Event()

    async def hold_until_go(conn: Conn) -> None:
        while await conn.read_request() is not None:
            await go.wait()
            await conn.send(fixed(b"{}"))

    server = await serve(hold_until_go)
    client = make_client(limit_per_endpoint=1)
    assert client.waiting(server.url) == 0
    first = asyncio.create_task(client.post(server.url, "/v1/completions", b"{}", {}))
    queued = [asyncio.create_task(client.post(server.url, "/v1/completions", b"{}", {})) for _ in range(2)]

    async def two_waiting() -> bool:
        return client.waiting(server.url) == 2

    await wait_until(two_waiting, what="two requests waiting for the one connection")
    queued[1].cancel()  # a waiter that gives up (client gone, timeout) leaves the queue
    with contextlib.suppress(asyncio.CancelledError):
        await queued[1]
    assert client.waiting(server.url) == 1
    go.set()
    async with within():
        response = await first
        await response.read()
        response.release()
        second = await queued[0]
        await second.read()
        second.release()
    assert client.waiting(server.url) == 0
    assert client.waiting("http://127.0.0.1:1") == 0  # no pool yet


def _fresh_endpoint(waiting: float = 0, in_flight: int = 0) -> Endpoint:
    endpoint = Endpoint(url="http://e1:8000")
    endpoint.metrics.waiting = waiting
    endpoint.metrics.running = 0
    endpoint.metrics.kv_usage = 0.0
    endpoint.metrics.scraped_at = 1.0
    endpoint.metrics.stale = False
    endpoint.in_flight = in_flight
    return endpoint


def test_saturation_counts_the_pool_queue_as_queued() -> None:
    detector = SaturationDetector(AdmissionConfig(queue_depth_threshold=5))
    endpoint = _fresh_endpoint(waiting=0, in_flight=8)
    assert detector.saturated(endpoint) is False
    pooled = {"n": 6}
    detector.pool_waiting = lambda e: pooled["n"]
    assert detector.estimated_waiting(endpoint) == 6
    assert detector.saturated(endpoint) is True
    pooled["n"] = 2
    assert detector.saturated(endpoint) is False
    endpoint.metrics.stale = True  # stale: unknown, unless the gateway's own queue says so
    pooled["n"] = 5
    assert detector.saturated(endpoint) is True
    pooled["n"] = 0
    assert detector.saturated(endpoint) is None


def test_pool_waiting_gauge_is_exported_per_endpoint() -> None:
    metrics = GatewayMetrics()
    endpoint = _fresh_endpoint()
    metrics.watch_endpoints(lambda: [endpoint], lambda e: 0)
    text = generate_latest(metrics.registry).decode()
    assert "llm_gateway_endpoint_pool_waiting_requests" in text  # HELP/TYPE even before wiring
    metrics.watch_pool_waiting(lambda e: 3)
    text = generate_latest(metrics.registry).decode()
    assert 'llm_gateway_endpoint_pool_waiting_requests{endpoint="e1:8000"} 3.0' in text
