"""P/D disaggregation end to end: real simulators (prefill and decode roles) behind an in-process gateway."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from loadtest.simulator import RunningSimulator
from tests.proxy.pd.helpers import (
    MODEL,
    PROTOCOLS,
    endpoints,
    finished,
    gw_metric,
    long_prompt,
    pd_counts,
    sim_metric,
)
from tests.support.harness import Gateway, wait_until

pytestmark = pytest.mark.parametrize("protocol", PROTOCOLS)


@dataclass
class PD:
    gw: Gateway
    prefills: list[RunningSimulator]
    decodes: list[RunningSimulator]

    @property
    def decode(self) -> RunningSimulator:
        return self.decodes[0]


@pytest.fixture
def pd_stack(start_sim, start_gateway):
    async def start(
        protocol: str,
        n_prefill: int = 1,
        prefill_kw: dict[str, Any] | None = None,
        decode_kw: dict[str, Any] | None = None,
        **pd: Any,
    ) -> PD:
        prefills = [
            await start_sim(engine=protocol, role="prefill", **(prefill_kw or {})) for _ in range(n_prefill)
        ]
        decode = await start_sim(engine=protocol, role="decode", **(decode_kw or {}))
        pd = {"protocol": protocol, "decider": "always", **pd}
        gw = await start_gateway(endpoints(protocol, prefills, [decode]), pd=pd)
        return PD(gw, prefills, [decode])

    return start


async def fault(http: aiohttp.ClientSession, sim: RunningSimulator, **body: Any) -> None:
    async with http.post(sim.url + "/admin/fault", json=body) as r:
        assert r.status == 200, await r.text()


async def chat(http: aiohttp.ClientSession, gw: Gateway, content: str, **extra: Any) -> tuple[int, dict]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}
    async with http.post(gw.url + "/v1/chat/completions", json=body) as r:
        return r.status, await r.json()


async def test_decode_receives_valid_transfer_and_skips_prefill(protocol, pd_stack, http) -> None:
    pd = await pd_stack(protocol)
    status, body = await chat(http, pd.gw, long_prompt())
    assert status == 200, body
    usage = body["usage"]
    assert usage["prompt_tokens"] > 900
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    assert pd_counts(pd.decode) == (1, 0)
    assert await sim_metric(http, pd.decode, "sim:pd_transfers_total", outcome="honoured") == 1
    assert finished(pd.prefills[0]) == 1  # the prefill leg really ran there
    assert await gw_metric(http, pd.gw, "llm_gateway_pd_decisions_total", mode="disaggregated") == 1
    assert await gw_metric(http, pd.gw, "llm_gateway_pd_degraded_total") == 0


async def test_streaming_with_openai_client(protocol, pd_stack, openai_client) -> None:
    pd = await pd_stack(protocol)
    client = openai_client(pd.gw)
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": long_prompt(tag="c")}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = [], None
    async for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(text) and usage is not None and usage.completion_tokens == 8
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1

    stream = await client.completions.create(
        model=MODEL,
        prompt=long_prompt(tag="t"),
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, cusage = [], None
    async for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
        if chunk.usage is not None:
            cusage = chunk.usage
    assert len(pieces) == 6 and cusage is not None
    assert cusage.prompt_tokens_details.cached_tokens == cusage.prompt_tokens - 1
    assert pd_counts(pd.decode) == (2, 0)


async def test_prefix_aware_decider(protocol, pd_stack, http) -> None:
    pd = await pd_stack(protocol, decider="prefix-aware", threshold_tokens=256)
    status, body = await chat(http, pd.gw, "hello there, short one")
    assert status == 200, body
    assert finished(pd.prefills[0]) == 0 and pd.prefills[0].engine.stats.steps == 0  # never saw a request
    assert pd_counts(pd.decode) == (0, 0)
    assert (
        await gw_metric(
            http, pd.gw, "llm_gateway_pd_decisions_total", mode="decode_only", reason="uncached_prompt_short"
        )
        == 1
    )
    status, body = await chat(http, pd.gw, long_prompt(tag="l"))
    assert status == 200, body
    assert finished(pd.prefills[0]) == 1 and pd_counts(pd.decode) == (1, 0)
    assert (
        await gw_metric(
            http, pd.gw, "llm_gateway_pd_decisions_total", mode="disaggregated", reason="uncached_prompt_long"
        )
        == 1
    )


async def test_prefill_failure_retried_on_other_prefill(protocol, pd_stack, http) -> None:
    pd = await pd_stack(protocol, n_prefill=2)
    prompt = long_prompt(tag="r")
    status, _ = await chat(http, pd.gw, prompt)
    assert status == 200
    first = next(p for p in pd.prefills if finished(p) == 1)  # prefix-cost sends this prompt there again
    other = next(p for p in pd.prefills if p is not first)
    await fault(http, first, mode="error", status=500)
    status, body = await chat(http, pd.gw, prompt, max_tokens=5)
    assert status == 200, body
    assert finished(other) == 1
    assert pd_counts(pd.decode) == (2, 0)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == body["usage"]["prompt_tokens"] - 1
    if protocol == "vllm":  # vLLM prefills before decoding: the failure is seen and the next replica tried
        assert await gw_metric(http, pd.gw, "llm_gateway_pd_prefill_failures_total", kind="http_500") == 1


async def test_all_prefills_failing_falls_back_to_decode_only(protocol, pd_stack, http) -> None:
    pd = await pd_stack(protocol, n_prefill=2)
    for p in pd.prefills:
        await fault(http, p, mode="error", status=503)
    status, body = await chat(http, pd.gw, long_prompt(tag="f"))
    assert status == 200, body
    assert (
        await gw_metric(
            http, pd.gw, "llm_gateway_pd_decisions_total", mode="decode_only", reason="prefill_failed"
        )
        == 1
    )
    assert pd_counts(pd.decode) == (0, 0)  # decode-only: no transfer params, no bootstrap room
    if protocol == "sglang":  # each concurrent prefill leg that failed was seen and counted
        assert await gw_metric(http, pd.gw, "llm_gateway_pd_degraded_total", reason="prefill_failed") == 2


async def test_prefill_failure_without_fallback_is_502(protocol, pd_stack, http) -> None:
    """SGLang too: its concurrent decode leg is abandoned when the prefill leg fails first."""
    pd = await pd_stack(protocol, n_prefill=2, fallback_to_decode=False)
    for p in pd.prefills:
        await fault(http, p, mode="error", status=500)
    status, body = await chat(http, pd.gw, long_prompt(tag="n"))
    assert status == 502, body
    err = body["error"]
    assert err["type"] == "upstream_error" and "prefill" in err["message"]
    assert finished(pd.decode) == 0  # SGLang's decode legs were aborted, not completed


async def test_prefill_without_transfer_detected(protocol, pd_stack, http) -> None:
    """A prefill replica that hands over no KV: the gateway counts the degradation."""
    pd = await pd_stack(protocol)
    await fault(http, pd.prefills[0], mode="no_transfer")
    status, body = await chat(http, pd.gw, long_prompt(tag="d"))
    assert status == 200, body
    reason = "no_transfer_params" if protocol == "vllm" else "recomputed"
    assert await gw_metric(http, pd.gw, "llm_gateway_pd_degraded_total", reason=reason) == 1
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_decode_recomputing_detected(protocol, pd_stack, http) -> None:
    """The prefill's KV is gone before the decode replica pulls it (TTL 0): the decode recomputes."""
    pd = await pd_stack(protocol, prefill_kw={"pd_ttl_s": 0.0})
    status, body = await chat(http, pd.gw, long_prompt(tag="e"))
    assert status == 200, body
    assert pd_counts(pd.decode) == (0, 1)
    assert await gw_metric(http, pd.gw, "llm_gateway_pd_degraded_total", reason="recomputed") == 1


async def test_client_disconnect_cancels_decode_and_prefill_legs(protocol, pd_stack, http) -> None:
    # Decode: ~1.2 ms per token for 4000 tokens; SGLang waits at most 1 s for the room.
    pd = await pd_stack(protocol, decode_kw={"time_scale": 5.0})
    prefill = pd.prefills[0]
    if protocol == "sglang":  # a prefill that is still running when the client leaves
        await fault(http, prefill, mode="slow", slow_factor=5000)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": long_prompt(tag="x")}],
        "max_tokens": 4000,
        "stream": True,
    }
    async with http.post(pd.gw.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        for _ in range(3):
            assert await r.content.readline() is not None
        await wait_until(lambda: _running(pd.decode, 1), 2.0, "decode to run")
        if protocol == "sglang":
            assert prefill.engine.state()["running"] == 1
        r.close()
    await wait_until(lambda: _running(pd.decode, 0), 3.0, "decode leg to be cancelled")
    await wait_until(lambda: _running(prefill, 0), 3.0, "prefill leg to be cancelled")
    assert pd.decode.engine.state()["finished"] == {"length": 0, "abort": 1}
    if protocol == "sglang":
        assert prefill.engine.state()["finished"] == {"length": 0, "abort": 1}
    assert await gw_metric(http, pd.gw, "llm_gateway_client_disconnects_total") >= 1


async def _running(sim: RunningSimulator, n: int) -> bool:
    await asyncio.sleep(0)
    return sim.engine.state()["running"] == n
