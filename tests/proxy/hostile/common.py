from __future__ import annotations

import contextlib
import logging
from typing import Any

from tests.proxy.hostile.raw import RawUpstream, running_raw
from tests.support.harness import chat_body, debug_endpoints, wait_idle

STICKY_HEALTH = {"interval_s": 60, "unhealthy_threshold": 100}


async def raw(stack: contextlib.AsyncExitStack, script) -> RawUpstream:
    return await stack.enter_async_context(running_raw(script))


def eps(*urls: str) -> list[dict[str, Any]]:
    return [{"url": u, "models": ["tiny"]} for u in urls]


async def gateway(start_gateway, *urls: str, **kw: Any):
    kw.setdefault("policy", "round-robin")
    kw.setdefault("health", STICKY_HEALTH)
    kw.setdefault("scrape", {"enabled": False})
    return await start_gateway(eps(*urls), **kw)


async def post(http, gw, stream: bool = False, **extra) -> tuple[int, bytes, dict]:
    async with http.post(gw.url + "/v1/chat/completions", json=chat_body(stream=stream, **extra)) as resp:
        return resp.status, await resp.read(), dict(resp.headers)


def errors(caplog) -> list[str]:
    return [
        f"{r.name}: {r.getMessage()}\n{r.exc_text or ''}"
        for r in caplog.records
        if r.levelno >= logging.ERROR
    ]


async def healthy_after(http, gw, good_url: str | None = None) -> None:
    """In-flight counters back at 0 and the gateway still answers."""
    await wait_idle(http, gw, within_s=3.0)
    rows = await debug_endpoints(http, gw)
    assert all(r["in_flight"] == 0 for r in rows.values()), rows
    for ep in gw.state.registry:
        assert ep.pending_prefill_tokens == 0, (ep.name, ep.pending_prefill_tokens)
