"""A client that goes away mid-request frees the real engine: vLLM aborts the request.

Proof of the abort is the engine's own accounting: the request generated tokens, never
finished (``vllm:request_success_total{finished_reason="length"}`` does not move although
``ignore_eos`` would have made it run to ``max_tokens``), and ``vllm:num_requests_running``
returns to 0. (vLLM does not count client aborts under ``finished_reason="abort"``.)
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.e2e_vllm.conftest import Fleet
from tests.e2e_vllm.helpers import MODEL, engine_metric
from tests.support.harness import gateway_metrics, metric_value, wait_idle, wait_until

pytestmark = pytest.mark.slow
# tokens: 6-12 s of decoding on this machine, far longer than the tests wait. The prompt
# is ~180 tokens, so this fits the replicas' 2,048-token context (1,900 was cut to 1,868).
LONG = 1800
# /metrics of a busy CPU replica can take ~2 s to answer: allow for a couple of slow scrapes.
SETTLE_S = 6.0


def _long_body(stream: bool) -> dict:
    body = {"model": MODEL, "prompt": "disconnect " * 20, "max_tokens": LONG, "ignore_eos": True}
    return {**body, "stream": stream}


async def _accounts(http: aiohttp.ClientSession, urls: list[str]) -> dict[str, tuple[float, float]]:
    """Per replica: (generated tokens, requests finished by reaching max_tokens), taken once
    the engines run nothing: an earlier test's request finishing inside this test's window
    would otherwise count as this test's."""
    for url in urls:

        async def idle(url: str = url) -> bool:
            return await engine_metric(http, url, "vllm:num_requests_running") == 0

        await wait_until(idle, SETTLE_S, f"vllm:num_requests_running on {url} to be 0 before the test")
    out = {}
    for url in urls:
        generated = await engine_metric(http, url, "vllm:generation_tokens_total")
        finished = await engine_metric(http, url, "vllm:request_success_total", finished_reason="length")
        out[url] = (generated, finished)
    return out


async def _engine_aborted(http: aiohttp.ClientSession, urls: list[str], before: dict) -> str | None:
    """None if the engines aborted the cut request, else what they did instead."""
    for url in urls:

        async def idle(url: str = url) -> bool:
            return await engine_metric(http, url, "vllm:num_requests_running") == 0

        await wait_until(idle, SETTLE_S, f"vllm:num_requests_running on {url} to return to 0")
    after = await _accounts(http, urls)
    generated = sum(after[u][0] - before[u][0] for u in urls)
    finished = sum(after[u][1] - before[u][1] for u in urls)
    assert generated > 0, "the request never reached an engine"
    if finished == 0 and generated < LONG:
        return None
    return f"the engine ran the request to max_tokens ({generated:.0f} tokens): not aborted"


async def _gateway_let_go(http: aiohttp.ClientSession, gw, disconnects: float) -> None:
    """The gateway's half, exact every time: it counted the client's going and closed the
    upstream connection (nothing in flight any more)."""

    async def counted() -> bool:
        value = metric_value(await gateway_metrics(http, gw), "llm_gateway_client_disconnects_total")
        return value == disconnects

    await wait_until(counted, 3.0, "the gateway to count the client's disconnect")
    await wait_idle(http, gw, within_s=3.0)


async def test_stream_disconnect_aborts_the_engine_request(fleet: Fleet, start_gateway, http) -> None:
    """The gateway's half is asserted on every try. The engine's is asserted to hold on one of
    three: under CI load a vLLM CPU replica has (rarely: twice in ~10 runs, not reproduced with
    or without CPU hogs, nor straight to vLLM in 12 tries) run a request cut by a closed
    connection to its end; the gateway had let go of it each time."""
    gw = await start_gateway(fleet.urls, policy="round-robin")
    misses = []
    for attempt in range(1, 4):
        before = await _accounts(http, fleet.urls)
        resp = await http.post(gw.url + "/v1/completions", json=_long_body(stream=True))
        assert resp.status == 200
        chunks = 0
        async for line in resp.content:
            chunks += line.startswith(b"data: ")
            if chunks == 5:
                break
        resp.close()  # the client goes away mid-stream
        await _gateway_let_go(http, gw, disconnects=attempt)
        miss = await _engine_aborted(http, fleet.urls, before)
        if miss is None:
            break
        misses.append(miss)
    else:
        raise AssertionError(f"three cut requests, none aborted by the engine: {misses}")


async def _engines_running(http: aiohttp.ClientSession, urls: list[str]) -> float:
    counts = await asyncio.gather(*(engine_metric(http, u, "vllm:num_requests_running") for u in urls))
    return sum(counts)


async def _caught_decoding(http: aiohttp.ClientSession, urls: list[str], request: asyncio.Task) -> bool:
    """True once an engine decodes ``request`` while the client still waits for it; False if the
    request completed first (a fast host decodes the whole answer between two looks)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETTLE_S
    while not request.done():
        if await _engines_running(http, urls) >= 1 and not request.done():
            return True
        if loop.time() >= deadline:
            raise AssertionError(f"timed out after {SETTLE_S}s waiting for the engine to decode the request")
        await asyncio.sleep(0.02)
    return False


async def _answered(http: aiohttp.ClientSession, gw) -> float:
    return metric_value(await gateway_metrics(http, gw), "llm_gateway_requests_total", status="200") or 0.0


async def _finished_before_the_cut(
    http: aiohttp.ClientSession, gw, disconnects: float, answered: float
) -> bool:
    """True if the engine finished and the gateway had the whole answer before the client left.

    A look at the engines' /metrics can take ~2 s on a busy CPU replica: "running" may be
    seconds old when the client cuts, and a fast host decodes the rest meanwhile (CI did: the
    gateway answered, nothing to count). Exactly one of the two counters moves."""
    outcome: list[tuple[bool, bool]] = []

    async def settled() -> bool:
        text = await gateway_metrics(http, gw)
        cut = metric_value(text, "llm_gateway_client_disconnects_total") == disconnects + 1
        done = (metric_value(text, "llm_gateway_requests_total", status="200") or 0.0) == answered + 1
        outcome[:] = [(cut, done)]
        return cut or done

    await wait_until(settled, 3.0, "the gateway to count the client's disconnect or its answer")
    cut, done = outcome[0]
    assert not (cut and done), "one request counted both as answered and as cut"
    return done


async def test_non_streaming_disconnect_aborts_the_engine_request(fleet: Fleet, start_gateway, http) -> None:
    """As the stream test: the gateway's half on every cut, the engine's on one of three."""
    gw = await start_gateway(fleet.urls, policy="round-robin")

    async def call() -> tuple[int, str]:
        async with http.post(gw.url + "/v1/completions", json=_long_body(stream=False)) as resp:
            return resp.status, await resp.text()

    # The client goes away while the engine decodes (not at a fixed time, which on a loaded
    # host can fall before the engine took the request): a non-streamed answer sends no
    # byte until it is complete, so only the closed connection can tell the engine. On a
    # fast host the engine can finish all LONG tokens before a look at /metrics sees it
    # running (CI did once); such a try proves nothing either way, so it is made again.
    cuts, misses = 0, []
    for _attempt in range(5):
        before = await _accounts(http, fleet.urls)
        answered = await _answered(http, gw)
        request = asyncio.create_task(call())
        if not await _caught_decoding(http, fleet.urls, request):
            status, _ = request.result()
            assert status == 200
            continue
        request.cancel()
        await asyncio.gather(request, return_exceptions=True)
        assert request.cancelled()
        if await _finished_before_the_cut(http, gw, disconnects=cuts, answered=answered):
            continue
        cuts += 1
        await _gateway_let_go(http, gw, disconnects=cuts)
        miss = await _engine_aborted(http, fleet.urls, before)
        if miss is None:
            return
        misses.append(miss)
        if cuts == 3:
            break
    raise AssertionError(f"{cuts} requests cut while decoding, none aborted by the engine: {misses}")
