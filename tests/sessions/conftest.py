"""Fixtures for the sticky-session suite: stoppable simulators, a real Redis, fast gateways.

Redis follows the prefix suite's rule (shared 127.0.0.1:6379 if it answers PING, else a
private ``redis-server``; under ``CI=true`` a missing Redis fails, never skips), with a
unique ``key_prefix`` per test whose keys are deleted afterwards. The fixtures are
imported from ``tests/prefix/conftest.py`` rather than copied.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web

from loadtest.simulator import RunningSimulator, SimConfig
from loadtest.simulator.server import start_runner
from tests.prefix.conftest import key_prefix, redis_servers, redis_url  # noqa: F401  (fixtures)
from tests.support.harness import Gateway

MODEL = "sim-llama"

# Health and scrapes fast enough that a stopped or saturated replica is seen within ~0.3 s (a
# stopped one refuses at once); the probe timeout is longer, because gateway, simulators and
# client share the test's event loop, and on a busy machine a 0.3 s pause of it read as a
# dead replica (503 "no healthy endpoint" in the middle of a test).
FAST: dict[str, Any] = {
    "health": {"interval_s": 0.1, "timeout_s": 1.5, "unhealthy_threshold": 1},
    "scrape": {"interval_s": 0.1, "timeout_s": 0.3},
}


class StoppableSim:
    """A simulator whose listening socket can be closed mid-test (the replica dies)."""

    def __init__(self, runner: web.AppRunner, sim: RunningSimulator) -> None:
        self._runner: web.AppRunner | None = runner
        self.sim = sim
        self.url = sim.url
        self.name = sim.url.split("://", 1)[1]

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()


@pytest.fixture
def start_sims(stack: contextlib.AsyncExitStack):
    """``await start_sims(n)``: n simulators (time_scale 50) that a test may stop."""

    async def start(n: int, **kw: Any) -> list[StoppableSim]:
        kw.setdefault("time_scale", 50.0)
        kw.setdefault("model", MODEL)
        sims = []
        for _ in range(n):
            runner, sim = await start_runner(SimConfig(port=0, **kw))
            handle = StoppableSim(runner, sim)
            stack.push_async_callback(handle.stop)
            sims.append(handle)
        return sims

    return start


def fresh_prompt(tag: str = "") -> list[dict[str, str]]:
    """A prompt that shares no prefix block with any other: stickiness cannot come from the cache."""
    return [{"role": "user", "content": f"{uuid.uuid4().hex} {tag} tell me something new"}]


async def turn(
    client: openai.AsyncOpenAI,
    *,
    headers: dict[str, str] | None = None,
    model: str = MODEL,
    **body: Any,
) -> tuple[str, httpx.Headers]:
    """One chat turn through the real OpenAI SDK; returns (serving endpoint, response headers)."""
    body.setdefault("messages", fresh_prompt())
    body.setdefault("max_tokens", 4)
    raw = await client.chat.completions.with_raw_response.create(
        model=model, extra_headers=headers or {}, **body
    )
    completion = raw.parse()
    assert completion.choices, "a completed turn has a choice"
    endpoint = raw.headers.get("x-gateway-endpoint")
    assert endpoint, "every proxied response names its endpoint"
    return endpoint, raw.headers


def session_gateway_kw(**sessions: Any) -> dict[str, Any]:
    kw: dict[str, Any] = {"policy": "session-aware", **FAST}
    if sessions:
        kw["sessions"] = sessions
    return kw


async def started_gateway(start_gateway, urls: list[str], **sessions: Any) -> Gateway:
    return await start_gateway(urls, **session_gateway_kw(**sessions))
