"""Helpers shared by the edge-case suites: admin key, a one-tenant keys file, plain chat posts,
ejection counts, and upstreams that hold or slow their answers."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import aiohttp
import yaml
from aiohttp import web

from gateway.auth import hash_key
from tests.support.harness import chat_body, gateway_metrics, metric_value
from tests.support.upstreams import Upstream

# Health probes that never flip on their own: only what real requests see matters here.
STICKY_HEALTH = {"interval_s": 60, "unhealthy_threshold": 100}
ADMIN_KEY = "admin-secret-r"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
ADMIN_SHA = hashlib.sha256(ADMIN_KEY.encode()).hexdigest()
TENANT_KEY = "sk-tenant"


def keys_yaml(path, **tenant: Any) -> str:
    """A keys file with one tenant ``t`` (``tenant``: its limits) holding ``TENANT_KEY``."""
    path.write_text(
        yaml.safe_dump({"tenants": {"t": tenant}, "keys": [{"sha256": hash_key(TENANT_KEY), "tenant": "t"}]})
    )
    return str(path)


async def post_chat(http: aiohttp.ClientSession, gw, headers=None, **extra) -> tuple[int, str | None]:
    async with http.post(gw.url + "/v1/chat/completions", json=chat_body(**extra), headers=headers) as resp:
        await resp.read()
        return resp.status, resp.headers.get("x-gateway-endpoint")


async def ejections(http, gw, endpoint: str | None = None) -> float:
    labels = {} if endpoint is None else {"endpoint": endpoint}
    text = await gateway_metrics(http, gw)
    return metric_value(text, "llm_gateway_endpoint_ejections_total", **labels) or 0.0


class HeldThen500(Upstream):
    """Non-streamed requests wait for ``gate``, then fail with a 500 (in-flight failures on demand)."""

    async def _complete(self, request: web.Request, chat: bool, model: str) -> web.StreamResponse:
        if self.mode == "held-500":
            await self.gate.wait()
            return web.Response(status=500, body=self.body, content_type="application/json")
        return await super()._complete(request, chat, model)


async def start_own(stack, cls: type[Upstream]) -> Upstream:
    upstream = cls()
    await upstream.start()
    stack.push_async_callback(upstream.stop)
    return upstream


class SlowUpstream(Upstream):
    """Answers non-streamed requests correctly, but only after ``delay_s`` (a long generation)."""

    delay_s = 0.8

    async def _complete(self, request: web.Request, chat: bool, model: str) -> web.StreamResponse:
        await asyncio.sleep(self.delay_s)
        return await super()._complete(request, chat, model)
