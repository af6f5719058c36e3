"""Start a real gateway in-process on a real port, and read its operational endpoints."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import load_config
from gateway.http.app import build_app
from gateway.http.server import start_site
from gateway.http.state import STATE, GatewayState
from gateway.scheduling.registry import PluginRegistry

__all__ = [
    "Gateway",
    "chat_body",
    "completion_body",
    "debug_endpoints",
    "free_port",
    "gateway_metrics",
    "metric_value",
    "running_gateway",
    "wait_idle",
    "wait_until",
]

# Fast health checks and scrapes so tests never wait on the defaults. The probe timeout is
# generous: gateway and upstreams share the test's event loop, and a pause of it (a full GC
# after the fuzz tests, a busy CI box) must not read as two failed probes. Refused
# connections and 503s still fail a probe at once.
_TEST_DEFAULTS: dict[str, Any] = {
    "health": {"interval_s": 0.5, "timeout_s": 2.0},
    "scrape": {"interval_s": 0.5, "timeout_s": 0.5},
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Gateway:
    url: str
    app: web.Application

    @property
    def state(self) -> GatewayState:
        return self.app[STATE]


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        out[key] = (
            _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out


@contextlib.asynccontextmanager
async def running_gateway(
    endpoints: list[str | dict[str, Any]],
    *,
    plugin_registry: PluginRegistry | None = None,
    **overrides: Any,
) -> AsyncIterator[Gateway]:
    """``endpoints``: URLs or full endpoint mappings; ``overrides``: config sections."""
    raw = _merge(_TEST_DEFAULTS, overrides)
    raw["endpoints"] = [{"url": e} if isinstance(e, str) else e for e in endpoints]
    config = load_config(overrides=raw, environ={})
    app = build_app(config, plugin_registry)
    port = free_port()
    runner = await start_site(
        app,
        "127.0.0.1",
        port,
        shutdown_timeout_s=config.server.shutdown_timeout_s,
        max_header_bytes=config.server.max_header_bytes,
        max_headers=config.server.max_headers,
    )
    try:
        yield Gateway(f"http://127.0.0.1:{port}", app)
    finally:
        await runner.cleanup()


def chat_body(model: str = "tiny", stream: bool = False, **extra: Any) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    if stream:
        body["stream"] = True
    return {**body, **extra}


def completion_body(model: str = "tiny", stream: bool = False, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "prompt": "hello", "max_tokens": 4}
    if stream:
        body["stream"] = True
    return {**body, **extra}


async def debug_endpoints(http: aiohttp.ClientSession, gw: Gateway) -> dict[str, dict[str, Any]]:
    """``/debug/endpoints`` keyed by endpoint URL."""
    async with http.get(gw.url + "/debug/endpoints") as resp:
        assert resp.status == 200
        payload = await resp.json()
    return {row["url"]: row for row in payload["endpoints"]}


def metric_value(text: str, sample: str, **labels: str) -> float | None:
    """Sum of the samples named ``sample`` whose labels include ``labels``; None if there is none."""
    total, found = 0.0, False
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
                found = True
    return total if found else None


async def gateway_metrics(http: aiohttp.ClientSession, gw: Gateway) -> str:
    async with http.get(gw.url + "/metrics") as resp:
        assert resp.status == 200
        return await resp.text()


async def wait_until(
    check: Callable[[], Awaitable[bool]], within_s: float = 2.0, what: str = "condition"
) -> None:
    """Poll ``check`` every 20 ms; fail the test if it is not true within ``within_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        if await check():
            return
        if loop.time() >= deadline:
            raise AssertionError(f"timed out after {within_s}s waiting for {what}")
        await asyncio.sleep(0.02)


async def wait_idle(http: aiohttp.ClientSession, gw: Gateway, within_s: float = 1.0) -> None:
    """Every in-flight counter — /debug/endpoints and the Prometheus gauges — is back to 0."""

    async def idle() -> bool:
        rows = await debug_endpoints(http, gw)
        if any(r["in_flight"] != 0 or r["in_flight_tokens"] != 0 for r in rows.values()):
            return False
        text = await gateway_metrics(http, gw)
        for family in text_string_to_metric_families(text):
            if family.name in (
                "llm_gateway_endpoint_in_flight_requests",
                "llm_gateway_endpoint_in_flight_prompt_tokens",
            ):
                if any(s.value != 0 for s in family.samples):
                    return False
        return True

    await wait_until(idle, within_s, "in-flight counters to return to 0")
