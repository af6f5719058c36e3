"""Shared helpers for the adversarial fleet-state tests (real sockets, real servers)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import web

from tests.support.upstreams import Upstream

MODEL = "sim-llama"
EXACT = {"exact": "auto", "kv_events": {"rediscover_s": 0.3, "replay_timeout_s": 1.0}}


def name_of(obj: Any) -> str:
    return obj.url.split("://", 1)[1]


class SourcesUpstream(Upstream):
    """The scriptable upstream, plus ``GET /kv_event_sources`` answering ``kv_sources`` (JSON)
    or ``kv_sources_raw`` (bytes) with ``kv_sources_status``."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.kv_sources: Any = None
        self.kv_sources_raw: bytes | None = None
        self.kv_sources_status = 200
        self.kv_sources_asked = 0

    own_paths = ("/tokenize",)

    def _add_routes(self, app: web.Application) -> None:
        super()._add_routes(app)
        app.router.add_get("/kv_event_sources", self._sources)
        app.router.add_post("/tokenize", self._tokenize)

    async def _tokenize(self, request: web.Request) -> web.Response:
        tokens = list(range(1, 200))
        return web.json_response({"tokens": tokens, "count": len(tokens), "max_model_len": 4096})

    async def _sources(self, request: web.Request) -> web.Response:
        self.kv_sources_asked += 1
        if self.kv_sources_raw is not None:
            return web.Response(status=self.kv_sources_status, body=self.kv_sources_raw)
        return web.json_response(self.kv_sources, status=self.kv_sources_status)


async def chat(http: aiohttp.ClientSession, url: str, content: str, model: str = MODEL) -> tuple[int, str]:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    async with http.post(url + "/v1/chat/completions", json=body, headers={"x-gateway-debug": "1"}) as r:
        return r.status, await r.text()


async def metrics_text(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url + "/metrics") as r:
        return await r.text()


async def wait_for(pred, within_s: float = 10.0, step: float = 0.05) -> None:
    """Poll ``pred`` (gateway state has no event to wait on) until true, or fail at ``within_s``."""
    async with asyncio.timeout(within_s):
        while not pred():  # noqa: ASYNC110
            await asyncio.sleep(step)
