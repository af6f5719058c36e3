"""The online latency model fed with outliers over real sockets: one slow cold-start answer, one
absurd scrape. The model must not be poisoned for the rest of the process (or for thousands of requests)."""

from __future__ import annotations

import asyncio
import contextlib
import math

from aiohttp import web

from gateway.admission.latency_model import OnlineLinearModel
from tests.admission.conftest import FAST, IDLE, body
from tests.support.upstreams import Upstream, vllm_metrics


class SlowFirstToken(Upstream):
    """Streams after ``delay_s`` (its time to first token); the very first stream after ``first_delay_s``."""

    delay_s = 0.0
    first_delay_s: float | None = None
    streams = 0

    async def _stream(self, request: web.Request, chat: bool, model: str) -> web.StreamResponse:
        self.streams += 1
        delay = self.first_delay_s if self.streams == 1 and self.first_delay_s is not None else self.delay_s
        await asyncio.sleep(delay)
        return await super()._stream(request, chat, model)


async def _own(stack: contextlib.AsyncExitStack, upstream: Upstream) -> Upstream:
    await upstream.start()
    stack.push_async_callback(upstream.stop)
    return upstream


async def _stream(http, gw, priority: str = "standard", **headers: str) -> tuple[int, str]:
    headers = {"x-priority": priority, **headers}
    async with http.post(gw.url + "/v1/chat/completions", json=body(stream=True), headers=headers) as r:
        return r.status, await r.text()


def _predicted_ms(gw, up: Upstream, priority: str = "sheddable") -> float:
    endpoint = gw.state.registry.get(up.url)
    return gw.state.plugin_context.latency.predict_ttft(endpoint, 8, priority)


async def test_one_slow_first_answer_does_not_make_a_fast_replica_shed(stack, start_gateway, http) -> None:
    """A cold engine's first answer takes 6 s (graph capture, a model load); every later one a few ms.
    The docstring promises that 'a handful of samples cannot produce wild coefficients' and that outliers
    are down-weighted; yet after 25 fast answers the replica is still predicted at hundreds of ms and a
    sheddable request with a 250 ms TTFT objective is refused as slo_unmeetable by an idle replica."""
    up = await _own(stack, SlowFirstToken())
    up.first_delay_s = 6.0
    gw = await start_gateway([up.url], policy="round-robin", **FAST)
    assert (await _stream(http, gw))[0] == 200  # the slow cold start
    for _ in range(25):  # the replica's normal speed: a few ms
        assert (await _stream(http, gw))[0] == 200
    predicted = _predicted_ms(gw, up)
    status, text = await _stream(http, gw, "sheddable", **{"x-slo-ttft-ms": "250"})
    assert status == 200, (status, text, f"predicted {predicted:.0f} ms for a replica answering in ~5 ms")
    assert predicted < 100, predicted


async def test_one_absurd_scrape_does_not_kill_the_latency_model_for_good(stack, start_gateway, http) -> None:
    """A replica's scrapes report vllm:num_requests_waiting 1e200 (finite, so it once passed as load)
    while streams are sent; then it answers every stream in ~300 ms. The absurd value is "not
    reported" (no saturation from it), and the model learns the real speed: before, its normal
    equations held inf, every refit failed, and it predicted ~0.1 ms for that replica for the rest
    of the process, so a sheddable request with a 50 ms objective was admitted (and missed)."""
    up = await _own(stack, SlowFirstToken())
    up.metrics_text = vllm_metrics(waiting=1e200, running=1, model="tiny")
    gw = await start_gateway([up.url], policy="round-robin", admission={"slo": {"min_samples": 5}}, **FAST)
    await asyncio.sleep(0.3)  # a few scrapes of it
    assert not gw.state.plugin_context.saturation.saturated(gw.state.registry.get(up.url))
    assert (await _stream(http, gw, "critical"))[0] == 200
    up.metrics_text = IDLE
    up.delay_s = 0.3
    for _ in range(12):  # the replica's real speed, learned over 12 answers
        assert (await _stream(http, gw))[0] == 200
    after = _predicted_ms(gw, up)
    latency = gw.state.plugin_context.latency
    coefficients = latency.coefficients(up.name), latency.coefficients(None)
    assert after > 100, (after, coefficients)
    status, _ = await _stream(http, gw, "sheddable", **{"x-slo-ttft-ms": "50"})
    assert status == 429, (after, coefficients)


def test_garbage_features_are_not_learned() -> None:
    """Straight at the model: a non-finite or absurd sample is skipped; the fit stays finite."""
    model = OnlineLinearModel((1.0, 1000.0))
    for _ in range(10):
        model.observe((1.0, 500.0), 20.0, (1.0, 0.01))
    before = model.theta
    for x, y in [((1.0, 1e200), 30.0), ((1.0, math.nan), 30.0), ((1.0, 500.0), math.inf)]:
        model.observe(x, y, (1.0, 0.01))
    assert model.theta == before and model.samples == 10
    assert all(math.isfinite(t) for t in model.theta)


async def test_streams_cut_mid_way_keep_the_model_finite_and_the_gateway_serving(
    start_upstream, start_gateway, http
) -> None:
    up = await start_upstream()
    gw = await start_gateway([up.url], policy="slo-aware", admission={"slo": {"min_samples": 2}}, **FAST)
    for mode in ["die", "cut-mid-event", "role-then-die", "ok"] * 6:
        up.mode = mode
        with contextlib.suppress(Exception):
            await _stream(http, gw, "standard", **{"x-slo-ttft-ms": "1000", "x-slo-tpot-ms": "1"})
    up.mode = "ok"
    latency = gw.state.plugin_context.latency
    for name in (None, up.name):
        for family in latency.coefficients(name).values():
            assert all(math.isfinite(v) and v >= 0 for v in family.values()), family
    assert (await _stream(http, gw, "sheddable", **{"x-slo-ttft-ms": "1000"}))[0] == 200
    await asyncio.sleep(0.1)
    assert gw.state.admission.in_flight == 0
