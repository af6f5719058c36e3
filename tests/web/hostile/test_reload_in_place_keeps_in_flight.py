"""A reload that changes an endpoint's settings in place (same URL: a label, an API key) keeps
counting the requests running on it, and they are released from the new object when they end
(found by review, 2026-12-05: the count fell to 0 and a replica at its concurrency cap took
more)."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from gateway.config import EndpointConfig, HealthConfig
from gateway.fleet.health import HealthTracker
from gateway.fleet.membership import FleetMembership
from gateway.fleet.registry import EndpointRegistry
from gateway.http.reload import apply_config
from gateway.ops.metrics import GatewayMetrics
from tests.support.harness import chat_body, debug_endpoints, wait_until


async def _stream(http, gw) -> tuple[int, str]:
    async with http.post(gw.url + "/v1/chat/completions", json=chat_body(stream=True)) as resp:
        return resp.status, (await resp.read()).decode()


async def test_in_flight_survives_an_in_place_endpoint_change(start_upstream, start_gateway, http):
    upstream = await start_upstream()
    gw = await start_gateway(
        [{"url": upstream.url, "labels": {"rev": "1"}}],
        admission={"endpoint_max_concurrency": 2, "queue_timeout_s": 5.0},
    )
    state = gw.state
    upstream.mode = "gated"
    streams = [asyncio.create_task(_stream(http, gw)) for _ in range(2)]

    async def two_running() -> bool:
        return (await debug_endpoints(http, gw))[upstream.url]["in_flight"] == 2

    await wait_until(two_running, 2.0, "two streams in flight")
    sent_before = len(upstream.requests)

    # Same replica, one label changed (an api_key rotation does the same).
    changed = EndpointConfig(url=upstream.url, labels={"rev": "2"})
    await apply_config(state, state.config.model_copy(update={"endpoints": [changed]}))
    try:
        row = (await debug_endpoints(http, gw))[upstream.url]
        assert row["in_flight"] == 2, (
            f"two streams still run on the replica, /debug/endpoints says {row['in_flight']}"
        )
        # The replica is at its cap of 2: a third request must wait in the gateway's queue.
        third = asyncio.create_task(_stream(http, gw))
        await asyncio.sleep(0.3)
        assert len(upstream.requests) == sent_before, (
            "a third request was sent past endpoint_max_concurrency: 2"
        )
        upstream.gate.set()
        assert [status for status, _ in await asyncio.gather(*streams, third)] == [200, 200, 200]

        async def all_released() -> bool:
            return (await debug_endpoints(http, gw))[upstream.url]["in_flight"] == 0

        await wait_until(all_released, 2.0, "the streams released from the replaced endpoint")
        replaced = state.registry.get(upstream.url)
        assert replaced.in_flight == 0 and replaced.in_flight_tokens == 0
        assert replaced.pending_prefill_tokens == 0
    finally:
        upstream.gate.set()
        await asyncio.gather(*streams, return_exceptions=True)
        if "third" in locals():
            await asyncio.gather(third, return_exceptions=True)


async def test_in_flight_survives_an_endpoint_that_leaves_and_comes_back(start_upstream, start_gateway, http):
    """A config rolled back, a readiness flap, a DNS round without the record: the replica leaves
    the fleet and returns while its streams still run. Found by review, 2026-12-05: it came back
    counting 0, and took requests past its cap."""
    upstream, other = await start_upstream(), await start_upstream()
    gw = await start_gateway(
        [upstream.url, other.url],
        policy="round-robin",
        admission={"endpoint_max_concurrency": 2, "queue_timeout_s": 5.0},
    )
    state = gw.state
    upstream.mode = other.mode = "gated"
    streams = [asyncio.create_task(_stream(http, gw)) for _ in range(4)]
    third = None

    async def both_full() -> bool:
        rows = await debug_endpoints(http, gw)
        return rows[upstream.url]["in_flight"] == 2 and rows[other.url]["in_flight"] == 2

    try:
        await wait_until(both_full, 2.0, "two streams in flight on each replica")
        sent_before = len(upstream.requests) + len(other.requests)
        whole = state.config
        await apply_config(state, whole.model_copy(update={"endpoints": [EndpointConfig(url=other.url)]}))
        assert upstream.url not in (await debug_endpoints(http, gw))
        await apply_config(state, whole)  # back
        assert (await debug_endpoints(http, gw))[upstream.url]["in_flight"] == 2
        third = asyncio.create_task(_stream(http, gw))  # both at their cap: it waits in the queue
        await asyncio.sleep(0.3)
        assert len(upstream.requests) + len(other.requests) == sent_before, "a request was sent past the cap"
        upstream.gate.set()
        other.gate.set()
        assert [status for status, _ in await asyncio.gather(*streams, third)] == [200] * 5

        async def all_released() -> bool:
            rows = await debug_endpoints(http, gw)
            return rows[upstream.url]["in_flight"] == 0 and rows[other.url]["in_flight"] == 0

        await wait_until(all_released, 2.0, "every stream released")
        returned = state.registry.get(upstream.url)
        assert returned.in_flight_tokens == 0 and returned.pending_prefill_tokens == 0
        # Gone and back once more with nothing running: nothing is carried.
        await apply_config(state, whole.model_copy(update={"endpoints": [EndpointConfig(url=other.url)]}))
        await apply_config(state, whole)
        assert state.registry.get(upstream.url).in_flight == 0
    finally:
        upstream.gate.set()
        other.gate.set()
        await asyncio.gather(*streams, *([third] if third else []), return_exceptions=True)


def _dp2_metrics() -> str:
    labels = [f'engine="{rank}",model_name="tiny"' for rank in (0, 1)]
    return "".join(
        f"vllm:num_requests_running{{{lb}}} 0\nvllm:num_requests_waiting{{{lb}}} 0\n"
        f"vllm:kv_cache_usage_perc{{{lb}}} 0\n"
        for lb in labels
    )


async def test_requests_on_learned_ranks_survive_a_leave_and_return(start_upstream, start_gateway, http):
    """Its data-parallel ranks learned from /metrics (not configured): the one that came back had
    no ranks to carry the requests to, and counted none of them (review, 2026-12-05)."""
    upstream, other = await start_upstream(metrics_text=_dp2_metrics()), await start_upstream()
    gw = await start_gateway(
        [{"url": upstream.url, "models": ["tiny"]}, {"url": other.url, "models": ["other"]}],
        health={"interval_s": 0.1, "timeout_s": 0.3},
        scrape={"interval_s": 0.1, "timeout_s": 0.3},
    )
    state = gw.state
    await _until(lambda: _ranks(state, upstream.url) == 2, "the replica's two ranks learned")
    upstream.mode = "gated"
    streams = [asyncio.create_task(_stream(http, gw)) for _ in range(4)]
    try:
        await _until(lambda: _counted(state, upstream.url) == 4, "four streams counted")
        whole = state.config
        await apply_config(state, whole.model_copy(update={"endpoints": whole.endpoints[1:]}))
        assert state.registry.get(upstream.url) is None
        await apply_config(state, whole)
        assert _counted(state, upstream.url) == 4
        await asyncio.sleep(0.5)  # scraped again: the ranks stay, and so do their counts
        assert _ranks(state, upstream.url) == 2 and _counted(state, upstream.url) == 4
        upstream.gate.set()
        assert [status for status, _ in await asyncio.gather(*streams)] == [200] * 4
        await _until(lambda: _counted(state, upstream.url) == 0, "every stream released")
    finally:
        upstream.gate.set()
        await asyncio.gather(*streams, return_exceptions=True)


def _ranks(state, url: str) -> int:
    endpoint = state.registry.get(url)
    return len(endpoint.rank_targets) if endpoint is not None else 0


def _counted(state, url: str) -> int:
    endpoint = state.registry.get(url)
    return endpoint.in_flight + sum(t.in_flight for t in endpoint.rank_targets)


async def _until(predicate, what: str) -> None:
    async def check() -> bool:
        return predicate()

    await wait_until(check, 3.0, what)


async def test_a_replica_that_went_down_while_away_is_out_at_its_first_failed_probe(
    start_upstream, start_gateway, http
):
    """It comes back with the health of the copy that left (requests still run on it), but that
    copy was not probed while away: one failed probe takes it out, not ``unhealthy_threshold``
    of them a health interval apart (review, 2026-12-05: routable for 2+ s without a probe)."""
    upstream, other = await start_upstream(), await start_upstream()
    gw = await start_gateway(
        [upstream.url, other.url],
        policy="round-robin",
        health={"interval_s": 5.0, "timeout_s": 0.5, "unhealthy_threshold": 3},
        scrape={"enabled": False},
    )
    state = gw.state
    upstream.mode = "gated"
    streams = [asyncio.create_task(_stream(http, gw)) for _ in range(2)]  # one lands on each
    try:
        await _until(lambda: _counted(state, upstream.url) == 1, "a stream on the replica")
        whole = state.config
        await apply_config(state, whole.model_copy(update={"endpoints": whole.endpoints[1:]}))
        upstream.healthy = False  # down while away: its /health answers 503
        await apply_config(state, whole)
        await _until(
            lambda: upstream.url not in {e.url for e in state.registry.candidates("tiny")},
            "the returned replica out of rotation after its first probe",
        )
        assert _counted(state, upstream.url) == 1  # its stream still counted
    finally:
        upstream.gate.set()
        other.gate.set()
        await asyncio.gather(*streams, return_exceptions=True)


def test_inherited_health_survives_an_in_place_replacement() -> None:
    """Replaced in place (a label, a key) before its first probe: the successor's health is still
    the departed copy's word, and one failed probe takes it out (review, 2026-12-05)."""
    registry = EndpointRegistry()
    membership = FleetMembership(registry)
    tracker = HealthTracker(
        registry, HealthConfig(unhealthy_threshold=2), GatewayMetrics(CollectorRegistry())
    )
    url = "http://127.0.0.1:9"
    membership.apply("dns", [EndpointConfig(url=url, models=["m"])])
    first = registry.get(url)
    first.healthy, first.in_flight = True, 1  # a stream still runs on it
    membership.apply("dns", [])  # a DNS round without it
    membership.apply("dns", [EndpointConfig(url=url, models=["m"])])
    assert registry.get(url).inherited_health
    membership.apply("dns", [EndpointConfig(url=url, models=["m"], labels={"zone": "b"})])
    successor = registry.get(url)
    assert successor.healthy and successor.inherited_health and successor.in_flight == 1
    tracker.record(successor, False)
    assert not successor.healthy
