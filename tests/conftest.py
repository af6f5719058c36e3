"""Shared fixtures: everything a test starts goes on one exit stack, torn down in reverse order."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
import uvloop

from loadtest.simulator import RunningSimulator, SimConfig, running_simulator
from tests.support.harness import Gateway, running_gateway
from tests.support.upstreams import Upstream, running_upstream


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Any]:
    """Run every async test on uvloop: the loop the gateway runs on in production."""
    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture
async def stack() -> AsyncIterator[contextlib.AsyncExitStack]:
    async with contextlib.AsyncExitStack() as exit_stack:
        yield exit_stack


@pytest.fixture
async def http(stack: contextlib.AsyncExitStack) -> aiohttp.ClientSession:
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15))
    return await stack.enter_async_context(session)


@pytest.fixture
def start_sim(stack: contextlib.AsyncExitStack):
    """``await start_sim(model="m")``: a simulator (time_scale 50) on a free port."""

    async def start(**kw: Any) -> RunningSimulator:
        kw.setdefault("time_scale", 50.0)
        return await stack.enter_async_context(running_simulator(SimConfig(port=0, **kw)))

    return start


@pytest.fixture
def start_upstream(stack: contextlib.AsyncExitStack):
    """``await start_upstream(models=("tiny",), metrics_text=None)``: a tiny controllable upstream."""

    async def start(models: tuple[str, ...] = ("tiny",), metrics_text: str | None = None) -> Upstream:
        return await stack.enter_async_context(running_upstream(models, metrics_text))

    return start


@pytest.fixture
def start_gateway(stack: contextlib.AsyncExitStack):
    """``await start_gateway([url, ...], policy="round-robin", ...)``: a real gateway on a real port."""

    async def start(endpoints: list[Any], **kw: Any) -> Gateway:
        return await stack.enter_async_context(running_gateway(endpoints, **kw))

    return start


@pytest.fixture
def openai_client(stack: contextlib.AsyncExitStack):
    """``openai_client(gw)``: the real OpenAI SDK pointed at the gateway, without SDK retries."""

    def make(gw: Gateway) -> openai.AsyncOpenAI:
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="test", max_retries=0, timeout=10)
        stack.push_async_callback(client.close)
        return client

    return make
