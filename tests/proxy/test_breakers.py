"""Circuit breaker, outlier ejection, stall detection and the retry budget, over real sockets."""

from __future__ import annotations

import asyncio
import time

from gateway.config import ResilienceConfig
from gateway.fleet.endpoint import Endpoint
from gateway.fleet.registry import EndpointRegistry
from gateway.ops.metrics import GatewayMetrics
from gateway.proxy.resilience import CircuitBreakers, RetryBudget, SlidingCounter, backoff_s
from tests.support.harness import (
    chat_body,
    debug_endpoints,
    gateway_metrics,
    metric_value,
    wait_idle,
    wait_until,
)

# Health probes that never flip on their own: only what real requests see matters here.
STICKY_HEALTH = {"interval_s": 60, "unhealthy_threshold": 100}
FAST_BREAKER = {"ejection_s": 0.5, "max_ejection_s": 4, "check_interval_s": 0.05, "stall_s": 0.4}


async def ejections(http, gw, endpoint: str, reason: str | None = None) -> float:
    labels = {"endpoint": endpoint} if reason is None else {"endpoint": endpoint, "reason": reason}
    text = await gateway_metrics(http, gw)
    return metric_value(text, "llm_gateway_endpoint_ejections_total", **labels) or 0.0


async def post_chat(http, gw, **extra):
    async with http.post(gw.url + "/v1/chat/completions", json=chat_body(**extra)) as resp:
        body = await resp.read()
        return resp.status, resp.headers.get("x-gateway-endpoint"), body


async def test_failing_endpoint_is_ejected_and_clients_see_no_error(start_upstream, start_gateway, http):
    bad, good1, good2 = await start_upstream(), await start_upstream(), await start_upstream()
    bad.mode, bad.status = "status", 500
    gw = await start_gateway(
        [bad.url, good1.url, good2.url],
        policy="round-robin",
        health=STICKY_HEALTH,
        resilience={**FAST_BREAKER, "ejection_s": 30},
    )
    served = []
    for _ in range(30):
        status, endpoint, _ = await post_chat(http, gw)
        assert status == 200  # each 500 was retried on a healthy endpoint before any byte went out
        served.append(endpoint)
    assert bad.name not in served
    assert len(bad.requests) == 3  # exactly the consecutive-failure threshold, then no more traffic
    assert await ejections(http, gw, bad.name, "http_500") == 1
    rows = await debug_endpoints(http, gw)
    assert rows[bad.url]["healthy"] is True  # /health still passes: the breaker, not health, ejected it
    text = await gateway_metrics(http, gw)
    assert metric_value(text, "llm_gateway_endpoint_ejected", endpoint=bad.name) == 1
    await wait_idle(http, gw)


async def _flaky_ejected(start_upstream, start_gateway, http):
    """Two replicas under round-robin; the first answers 500 until it is ejected (0.5 s)."""
    flaky, good = await start_upstream(), await start_upstream()
    flaky.mode, flaky.status = "status", 500
    gw = await start_gateway(
        [flaky.url, good.url], policy="round-robin", health=STICKY_HEALTH, resilience=FAST_BREAKER
    )
    for _ in range(6):
        assert (await post_chat(http, gw))[0] == 200
    assert gw.state.registry.get(flaky.url).ejected
    return flaky, gw


async def test_half_open_probe_brings_a_recovered_endpoint_back(start_upstream, start_gateway, http):
    flaky, gw = await _flaky_ejected(start_upstream, start_gateway, http)

    # Still broken when the ejection ends: the single probe fails and the ejection doubles.
    await asyncio.sleep(0.6)
    assert not gw.state.registry.get(flaky.url).ejected  # half-open: back in rotation for one probe
    before = len(flaky.requests)
    for _ in range(4):
        assert (await post_chat(http, gw))[0] == 200
    assert len(flaky.requests) == before + 1  # one probe, not a flood
    assert await ejections(http, gw, flaky.name, "probe_http_500") == 1

    flaky.mode = "ok"  # recovered; after the (doubled, 1 s) ejection the probe succeeds
    await asyncio.sleep(1.1)
    served = [(await post_chat(http, gw))[1] for _ in range(6)]
    assert served.count(flaky.name) == 3  # closed again: round-robin gives it its share
    assert gw.state.breakers.state(gw.state.registry.get(flaky.url)) == "closed"


async def test_hung_endpoint_is_detected_and_waiting_requests_are_resent(start_upstream, start_gateway, http):
    hung, good = await start_upstream(), await start_upstream()
    hung.mode = "hold"  # accepts the request, never answers; /health and /metrics stay fine
    gw = await start_gateway(
        [hung.url, good.url],
        policy="round-robin",
        health=STICKY_HEALTH,
        scrape={"interval_s": 0.1, "timeout_s": 0.1},
        resilience=FAST_BREAKER,
    )
    loop = asyncio.get_running_loop()
    started = loop.time()
    results = await asyncio.gather(*(post_chat(http, gw) for _ in range(6)))
    elapsed = loop.time() - started
    assert [r[0] for r in results] == [200] * 6  # nothing had reached the client: all re-sent
    assert {r[1] for r in results} == {good.name}
    assert elapsed < 3.0  # stall_s 0.4 plus a scrape, not the 300 s first-byte timeout
    assert await ejections(http, gw, hung.name, "stalled") == 1
    await wait_until(lambda: asyncio.sleep(0, hung.cancelled.is_set()), 2.0, "the hung upstream to be cut")
    await wait_idle(http, gw)


async def test_busy_engine_that_counts_our_requests_is_not_called_stalled(
    start_upstream, start_gateway, http
):
    from tests.support.upstreams import vllm_metrics

    slow, other = await start_upstream(), await start_upstream()
    slow.mode = "hold"
    slow.metrics_text = vllm_metrics(running=4)  # the engine says it is working on them
    gw = await start_gateway(
        [slow.url, other.url],
        policy="round-robin",
        health=STICKY_HEALTH,
        scrape={"interval_s": 0.1, "timeout_s": 0.1},
        resilience=FAST_BREAKER,
    )
    tasks = [asyncio.create_task(post_chat(http, gw)) for _ in range(4)]
    await asyncio.sleep(1.2)  # three stall windows
    assert await ejections(http, gw, slow.name) == 0
    assert not gw.state.registry.get(slow.url).ejected
    slow.mode = "ok"
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_never_ejects_more_than_the_allowed_share(start_upstream, start_gateway, http):
    a, b = await start_upstream(), await start_upstream()
    a.mode = b.mode = "status"
    a.status = b.status = 500
    gw = await start_gateway(
        [a.url, b.url],
        policy="round-robin",
        health=STICKY_HEALTH,
        resilience={**FAST_BREAKER, "ejection_s": 30},
    )
    statuses = [(await post_chat(http, gw))[0] for _ in range(12)]
    assert set(statuses) == {500}  # the fleet is broken: its own 500s pass through, not 503s
    rows = await debug_endpoints(http, gw)
    assert sum(1 for url in (a.url, b.url) if gw.state.registry.get(url).ejected) == 1
    assert all(r["healthy"] for r in rows.values())
    text = await gateway_metrics(http, gw)
    assert (metric_value(text, "llm_gateway_endpoint_ejections_skipped_total") or 0) >= 1


async def test_retry_budget_caps_retries(start_upstream, start_gateway, http):
    a, b = await start_upstream(), await start_upstream()
    a.mode, a.status = "status", 503
    gw = await start_gateway(
        [a.url, b.url],
        policy="round-robin",
        health=STICKY_HEALTH,
        resilience={
            "retry_budget_ratio": 0.0,
            "retry_budget_min_per_s": 0.2,
            "consecutive_failures": 100,
            "min_requests": 1000,
        },
    )
    # The floor allows 0.2/s × 10 s = 2 retries; later failures pass through.
    statuses = [(await post_chat(http, gw))[0] for _ in range(10)]
    assert statuses.count(503) == 3  # five requests hit the failing endpoint, two were retried
    text = await gateway_metrics(http, gw)
    assert metric_value(text, "llm_gateway_retry_budget_exhausted_total") == 3
    assert metric_value(text, "llm_gateway_retries_total") == 2


async def test_upstream_token_is_injected_and_the_client_key_never_forwarded(
    start_upstream, start_gateway, http, tmp_path
):
    with_key, with_file = await start_upstream(), await start_upstream()
    secret_file = tmp_path / "token"
    secret_file.write_text("file-token\n")
    gw = await start_gateway(
        [
            {"url": with_key.url, "api_key": "inline-token"},
            {"url": with_file.url, "api_key_file": str(secret_file)},
        ],
        policy="round-robin",
    )
    headers = {
        "authorization": "Bearer client-gateway-key",
        "x-api-key": "client-gateway-key",
        "cookie": "a=b",
        "connection": "keep-alive, x-hop",
        "x-hop": "1",
        "te": "trailers",
        "proxy-authorization": "Basic Zm9vOmJhcg==",
        "upgrade": "h2c",
    }
    for _ in range(2):
        async with http.post(gw.url + "/v1/chat/completions", json=chat_body(), headers=headers) as resp:
            assert resp.status == 200
    assert with_key.requests[0].headers["authorization"] == "Bearer inline-token"
    assert with_file.requests[0].headers["authorization"] == "Bearer file-token"
    for upstream in (with_key, with_file):
        sent = upstream.requests[0].headers
        assert "client-gateway-key" not in " ".join(sent.values())
        for hop in ("x-api-key", "cookie", "x-hop", "te", "proxy-authorization", "upgrade"):
            assert hop not in sent
    async with http.get(gw.url + "/debug/endpoints") as resp:
        assert "inline-token" not in await resp.text()


async def test_a_shutting_down_engines_aborted_answer_is_resent(start_upstream, start_gateway, http):
    stopping, good = await start_upstream(), await start_upstream()
    stopping.mode = "abort"  # 200 with finish_reason "abort", like vLLM on SIGTERM
    gw = await start_gateway([stopping.url, good.url], policy="round-robin", health=STICKY_HEALTH)
    for _ in range(4):
        async with http.post(gw.url + "/v1/chat/completions", json=chat_body()) as resp:
            assert resp.status == 200
            assert resp.headers["x-gateway-endpoint"] == good.name
            assert (await resp.json())["choices"][0]["finish_reason"] == "stop"
    text = await gateway_metrics(http, gw)
    assert metric_value(text, "llm_gateway_retries_total", reason="aborted") == 2
    assert (
        metric_value(text, "llm_gateway_upstream_errors_total", endpoint=stopping.name, kind="aborted") == 2
    )


async def test_a_replica_dying_after_the_role_chunk_is_retried_not_a_broken_stream(
    start_upstream, start_gateway, http
):
    dying, good = await start_upstream(), await start_upstream()
    dying.mode = "role-then-die"  # opens the chat stream with the role-only delta, then dies in prefill
    gw = await start_gateway([dying.url, good.url], policy="round-robin", health=STICKY_HEALTH)
    for _ in range(2):
        async with http.post(gw.url + "/v1/chat/completions", json=chat_body(stream=True)) as resp:
            assert resp.status == 200
            text = (await resp.read()).decode()
        assert resp.headers["x-gateway-endpoint"] == good.name
        assert "error" not in text and text.endswith("data: [DONE]\n\n")
    assert dying.first_chunk_sent.is_set()
    text = await gateway_metrics(http, gw)
    assert metric_value(text, "llm_gateway_retries_total", reason="disconnected") == 1


async def test_the_role_chunk_is_held_until_a_token_arrives(start_upstream, start_gateway, http):
    upstream = await start_upstream()
    upstream.mode = "role-then-gated"
    gw = await start_gateway([upstream.url])

    async def stream() -> str:
        async with http.post(gw.url + "/v1/chat/completions", json=chat_body(stream=True)) as resp:
            return (await resp.read()).decode()

    task = asyncio.create_task(stream())
    await asyncio.wait_for(upstream.first_chunk_sent.wait(), 2)
    await asyncio.sleep(0.2)
    assert not task.done()  # not even the response headers went out: the request is still retryable
    upstream.gate.set()
    text = await asyncio.wait_for(task, 5)
    assert '"role": "assistant"' in text.split("\n\n")[0]  # the role chunk is kept, first
    assert text.endswith("data: [DONE]\n\n")


def test_sliding_counter_forgets_old_seconds():
    counter = SlidingCounter(3)
    counter.add(100.2)
    counter.add(100.9, 2)
    counter.add(102.5)
    assert counter.total(102.9) == 4
    assert counter.total(103.0) == 1  # second 100 left the window
    assert counter.total(106.0) == 0


def test_retry_budget_ratio_and_floor():
    budget = RetryBudget(ratio=0.1, min_per_s=0.0, window_s=10)
    for i in range(50):
        budget.record_request(1000 + i * 0.1)
    spent = sum(budget.try_spend(1005.0) for _ in range(10))
    assert spent == 5  # 10 % of 50 requests
    assert not budget.try_spend(1005.0)
    assert budget.try_spend(1016.0) is False  # requests and retries both aged out: floor is 0


def test_backoff_is_bounded_full_jitter():
    values = [backoff_s(0.01, 3) for _ in range(200)]
    assert all(0 <= v <= 0.04 for v in values)
    assert max(values) > 0.02  # spread over the whole range, not a constant
    assert all(v <= 1.0 for v in (backoff_s(0.5, 10) for _ in range(50)))


async def test_a_probe_that_streams_brings_the_replica_back_at_its_first_byte(
    stack, start_upstream, start_gateway, http
):
    """The breaker used to close only when the probe ended: a long generation as the probe kept
    a recovered replica out of rotation for its whole stream."""
    flaky, gw = await _flaky_ejected(start_upstream, start_gateway, http)
    flaky.mode = "gated"  # recovered: streams its first chunk, then holds the rest
    stack.callback(flaky.gate.set)
    await asyncio.sleep(0.6)  # half-open
    endpoint = gw.state.registry.get(flaky.url)

    async def stream() -> str:
        async with http.post(gw.url + "/v1/chat/completions", json=chat_body(stream=True)) as resp:
            await resp.read()
            return resp.headers["x-gateway-endpoint"]

    before, streams = len(flaky.requests), []
    while len(flaky.requests) == before:  # round-robin: the probe lands on flaky within two
        streams.append(asyncio.create_task(stream()))
        await asyncio.sleep(0.05)
        assert len(streams) < 10
    await asyncio.wait_for(flaky.first_chunk_sent.wait(), 2.0)

    async def closed() -> bool:
        return gw.state.breakers.state(endpoint) == "closed" and not endpoint.ejected

    await wait_until(closed, 1.0, "the breaker closed at the probe's first byte")
    flaky.mode = "ok"  # later requests complete; the probe's stream is still held
    served = [(await post_chat(http, gw))[1] for _ in range(4)]
    assert served.count(flaky.name) == 2
    flaky.gate.set()
    assert (await asyncio.gather(*streams)).count(flaky.name) == 1  # one probe


async def test_a_replica_whose_streams_die_after_the_probes_first_byte_is_ejected_again_at_once(
    start_upstream, start_gateway, http
):
    """Closed at the probe's first byte, it is on probation until a request completes: its first
    failure re-ejects it (forced, as a failed probe), not after consecutive_failures more."""
    flaky, gw = await _flaky_ejected(start_upstream, start_gateway, http)
    flaky.mode = "die"  # one event, then the connection is cut
    await asyncio.sleep(0.6)  # half-open
    endpoint = gw.state.registry.get(flaky.url)
    for _ in range(4):  # round-robin: the probe lands on flaky within two
        async with http.post(gw.url + "/v1/chat/completions", json=chat_body(stream=True)) as resp:
            await resp.read()
        if endpoint.ejected and await ejections(http, gw, flaky.name, "probe_mid_stream") == 1:
            break
    assert endpoint.ejected
    assert await ejections(http, gw, flaky.name, "probe_mid_stream") == 1


def test_a_failure_on_probation_is_still_held_to_max_ejected_fraction():
    a, b = (
        Endpoint(u, configured_models=frozenset({"m"}), healthy=True) for u in ("http://a:1", "http://b:1")
    )
    registry = EndpointRegistry([a, b])
    config = ResilienceConfig(consecutive_failures=2, ejection_s=0.05, max_ejected_fraction=0.5)
    breakers = CircuitBreakers(config, registry, GatewayMetrics())
    breakers.on_failure(a, "http_500")
    breakers.on_failure(a, "http_500")
    time.sleep(0.06)
    breakers.review()  # half-open
    breakers.on_send(a)
    breakers.on_first_byte(a)  # the probe answers: back, on probation
    breakers.on_failure(b, "http_500")
    breakers.on_failure(b, "http_500")  # b is the one replica of two allowed out
    assert b.ejected and not a.ejected
    breakers.on_failure(a, "mid_stream")
    assert not a.ejected  # the model keeps a replica
