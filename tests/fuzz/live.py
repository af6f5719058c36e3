"""One real gateway + fake upstream on their own event loop in a background thread.

Hypothesis drives sync test functions and does not mix well with pytest-asyncio's
per-test loops, so the fuzz tests talk to this gateway over real sockets from the test
thread (httpx, raw sockets) while it serves on its own uvloop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import uvloop

from tests.support.harness import Gateway, running_gateway
from tests.support.upstreams import Upstream, running_upstream

__all__ = ["MAX_BODY_BYTES", "MAX_HEADERS", "MAX_HEADER_BYTES", "LiveGateway", "live_gateway"]

T = TypeVar("T")

# The fuzz gateway's limits: small, so the tests can cross them with small requests.
MAX_BODY_BYTES = 1 << 20
MAX_HEADERS = 16
MAX_HEADER_BYTES = 1024


@dataclass
class LiveGateway:
    url: str
    host: str
    port: int
    gateway: Gateway
    upstream: Upstream
    loop: asyncio.AbstractEventLoop

    def call(self, fn: Callable[[], T], timeout_s: float = 5.0) -> T:
        """Run ``fn`` on the gateway's loop (its objects are not thread-safe) and return its result."""

        async def run() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout_s)


@contextlib.contextmanager
def live_gateway(**overrides: Any) -> Iterator[LiveGateway]:
    """``overrides``: config sections, as for :func:`tests.support.harness.running_gateway`."""
    loop = uvloop.new_event_loop()
    started: concurrent.futures.Future[tuple[LiveGateway, asyncio.Event]] = concurrent.futures.Future()

    async def main() -> None:
        stop = asyncio.Event()
        async with running_upstream() as upstream, running_gateway([upstream.url], **overrides) as gw:
            host, port = gw.url.removeprefix("http://").split(":")
            started.set_result((LiveGateway(gw.url, host, int(port), gw, upstream, loop), stop))
            await stop.wait()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(main())
        except BaseException as exc:
            if not started.done():
                started.set_exception(exc)
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    thread = threading.Thread(target=serve, name="fuzz-gateway", daemon=True)
    thread.start()
    live, stop = started.result(timeout=20)
    try:
        yield live
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=15)
