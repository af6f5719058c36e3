"""Helpers for the admission suite: gateways with fast scrapes, raw requests, gauge readers.

Saturation comes either from a real simulator whose engine queue is deep (small
``max_num_seqs``, long outputs) or from a tiny upstream whose ``/metrics`` reports a deep
waiting queue (``vllm_metrics(waiting=10)`` ≥ the default threshold of 5).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any, TypeVar

import aiohttp
import pytest
from multidict import CIMultiDict

from tests.support.harness import Gateway, gateway_metrics, metric_value, wait_until
from tests.support.upstreams import Upstream, vllm_metrics

T = TypeVar("T")

FAST: dict[str, Any] = {
    "health": {"interval_s": 0.1, "timeout_s": 0.3},
    "scrape": {"interval_s": 0.1, "timeout_s": 0.3},
}
DEEP = vllm_metrics(waiting=10, running=8, model="tiny")
IDLE = vllm_metrics(model="tiny")


def deep(model: str = "tiny") -> str:
    return vllm_metrics(waiting=10, running=8, model=model)


async def admission_gateway(
    start_gateway, urls: list[str], policy: str = "round-robin", **admission: Any
) -> Gateway:
    return await start_gateway(urls, policy=policy, admission=admission, **FAST)


def gated(stack: contextlib.AsyncExitStack, up: Upstream) -> None:
    """Hold streams after their first chunk until ``up.gate`` opens.

    Call it after the gateway started: the exit stack then opens the gate before the
    gateway shuts down, so a failing test cannot leave held streams stalling teardown.
    """
    up.mode = "gated"
    stack.callback(up.gate.set)


def body(content: str = "hi", model: str = "tiny", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}


async def post(
    http: aiohttp.ClientSession,
    gw: Gateway,
    payload: dict[str, Any],
    priority: str | None = None,
    tenant: str | None = None,
) -> tuple[int, CIMultiDict[str], Any]:
    """One raw chat request; returns (status, headers, JSON body or the SSE text)."""
    headers = {}
    if priority is not None:
        headers["x-priority"] = priority
    if tenant is not None:
        headers["x-tenant-id"] = tenant
    async with http.post(gw.url + "/v1/chat/completions", json=payload, headers=headers) as resp:
        if resp.content_type == "application/json":
            return resp.status, CIMultiDict(resp.headers), await resp.json()
        return resp.status, CIMultiDict(resp.headers), await resp.text()  # an SSE stream, read to the end


async def metric(http: aiohttp.ClientSession, gw: Gateway, sample: str, **labels: str) -> float:
    return metric_value(await gateway_metrics(http, gw), sample, **labels) or 0.0


async def queue_length(http: aiohttp.ClientSession, gw: Gateway, priority: str = "standard") -> float:
    return await metric(http, gw, "llm_gateway_admission_queue_length", priority=priority)


async def wait_queue(
    http: aiohttp.ClientSession, gw: Gateway, n: int, priority: str = "standard", within_s: float = 3.0
) -> None:
    async def reached() -> bool:
        return await queue_length(http, gw, priority) == n

    await wait_until(reached, within_s, f"{priority} admission queue length == {n}")


async def wait_saturation(
    http: aiohttp.ClientSession, gw: Gateway, upstreams: list[Upstream], value: int, within_s: float = 3.0
) -> None:
    """Until the gateway's detector reports every one of ``upstreams`` saturated (1) or not (0)."""

    async def seen() -> bool:
        text = await gateway_metrics(http, gw)
        return all(
            metric_value(text, "llm_gateway_endpoint_saturated", endpoint=u.name) == value for u in upstreams
        )

    await wait_until(seen, within_s, f"saturation == {value} on {[u.name for u in upstreams]}")


async def settle(within_s: float = 0.3) -> None:
    """Give the gateway several scrape/ticker rounds (it wakes its queue every 50 ms)."""
    await asyncio.sleep(within_s)


def assert_rate_limited(status: int, headers: CIMultiDict[str], payload: Any, reason: str) -> None:
    assert status == 429, payload
    assert int(headers["Retry-After"]) >= 1
    error = payload["error"]
    assert error["type"] == "rate_limit_exceeded"
    assert error["code"] == f"rate_limit_exceeded.{reason}"
    assert isinstance(error["message"], str) and error["message"]


@pytest.fixture
def spawn(stack: contextlib.AsyncExitStack):
    """``spawn(coro)``: a client task that is cancelled (its connection closed) on exit.

    Spawned after the gateway started, the cancellation runs before the gateway shuts
    down, so a failing test cannot leave queued requests holding up teardown.
    """

    def start(coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.create_task(coro)

        async def cancel() -> None:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

        stack.push_async_callback(cancel)
        return task

    return start
