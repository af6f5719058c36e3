"""Fixtures for the prefix-cache suite: a real Redis, private redis-servers, simulators and gateways.

Redis rule: use the shared server at 127.0.0.1:6379 if it answers PING, else start a
private ``redis-server`` on a free port; if neither works, fail under ``CI=true`` and
skip otherwise. Every test gets its own ``key_prefix`` and its keys are deleted after.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from gateway.config import load_config
from gateway.http.app import build_app
from gateway.http.server import start_site
from loadtest.harness.ports import free_port
from loadtest.harness.redis_server import RedisServer
from loadtest.simulator import RunningSimulator, SimConfig, running_simulator
from tests.support.harness import Gateway

SHARED_REDIS_URL = "redis://127.0.0.1:6379/0"


def _pings(url: str, timeout: float = 0.5) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


def _redis_unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"Redis is required under CI=true: {reason}")
    pytest.skip(f"no Redis available: {reason}")


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a Redis that answers PING (the shared one, or a private one started here)."""
    if _pings(SHARED_REDIS_URL):
        yield SHARED_REDIS_URL
        return
    server = RedisServer()
    try:
        server.start()
    except (RuntimeError, OSError) as exc:
        _redis_unavailable(str(exc))
    try:
        yield server.url
    finally:
        server.kill()


@pytest.fixture
def key_prefix(redis_url: str) -> Iterator[str]:
    """A unique key prefix; every key under it is deleted from the test Redis afterwards.

    (Private redis-servers of the failure tests are killed, which drops their keys.)
    """
    prefix = f"llmgw-test-{uuid.uuid4().hex[:12]}"
    yield prefix
    client = redis.Redis.from_url(redis_url, socket_connect_timeout=0.5, socket_timeout=1.0)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)
    except (redis.RedisError, OSError):
        pass
    finally:
        client.close()


@pytest.fixture
def redis_servers() -> Iterator[Any]:
    """``redis_servers(port=None)``: a private redis-server (for failure tests); killed by PID after."""
    started: list[RedisServer] = []

    def start(port: int | None = None) -> RedisServer:
        server = RedisServer(port)
        try:
            server.start()
        except (RuntimeError, OSError) as exc:
            _redis_unavailable(str(exc))
        started.append(server)
        return server

    yield start
    for server in started:
        server.kill()


def scan_keys(url: str, prefix: str) -> list[str]:
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=1.0, decode_responses=True)
    try:
        return sorted(client.scan_iter(match=f"{prefix}:*", count=1000))
    finally:
        client.close()


# -- simulators and gateways ------------------------------------------------------------


# `stack` and `http` come from tests/conftest.py.


@pytest.fixture
def start_sims(stack: contextlib.AsyncExitStack):
    """``await start_sims(n, kv_blocks=...)``: n simulators (time_scale 20, block_size 16)."""

    async def start(n: int = 1, **kw: Any) -> list[RunningSimulator]:
        kw.setdefault("time_scale", 20.0)
        kw.setdefault("block_size", 16)
        kw.setdefault("model", "sim-llama")
        sims = []
        for _ in range(n):
            sims.append(await stack.enter_async_context(running_simulator(SimConfig(port=0, **kw))))
        return sims

    return start


# Fast health checks and scrapes so tests never wait on the defaults.
TEST_DEFAULTS: dict[str, Any] = {
    "health": {"interval_s": 0.25, "timeout_s": 0.5, "unhealthy_threshold": 2},
    "scrape": {"interval_s": 0.25, "timeout_s": 0.5},
}


def gateway_config(endpoints: list[str], **sections: Any) -> Any:
    raw: dict[str, Any] = {key: dict(value) for key, value in TEST_DEFAULTS.items()}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    raw["endpoints"] = [{"url": url} for url in endpoints]
    return load_config(overrides=raw, environ={})


class GatewayProcessless:
    """An in-process gateway on a real port that can be stopped and started again (same config)."""

    def __init__(self, config: Any, port: int | None = None) -> None:
        self.config = config
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.runner: Any = None
        self.gateway: Gateway | None = None

    async def start(self) -> Gateway:
        app = build_app(self.config)
        self.runner = await start_site(app, "127.0.0.1", self.port)
        self.gateway = Gateway(self.url, app)
        return self.gateway

    async def stop(self) -> None:
        runner, self.runner = self.runner, None
        if runner is not None:
            await runner.cleanup()


@pytest.fixture
def start_gateway(stack: contextlib.AsyncExitStack):
    """``await start_gateway(config)``: a handle whose ``stop()``/``start()`` restart the app."""

    async def start(config: Any) -> GatewayProcessless:
        handle = GatewayProcessless(config)
        await handle.start()
        stack.push_async_callback(handle.stop)
        return handle

    return start
