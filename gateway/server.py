"""Runs the gateway: one process, or several sharing the port through SO_REUSEPORT.

With several workers each process has its own endpoint view, scrapers and in-flight
counts (and its own /metrics); the kernel spreads connections across them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal

from aiohttp import web

from gateway.app import build_app
from gateway.config import GatewayConfig

__all__ = ["install_uvloop", "serve", "start_site"]

log = logging.getLogger(__name__)


def install_uvloop() -> bool:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a core dependency on Linux
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


async def start_site(
    app: web.Application, host: str, port: int, *, reuse_port: bool = False
) -> web.AppRunner:
    """Start ``app`` on host:port; ``handler_cancellation`` makes a client disconnect cancel the handler."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_port=reuse_port, backlog=2048)
    await site.start()
    return runner


async def _serve_one(config: GatewayConfig, reuse_port: bool) -> None:
    app = build_app(config)
    runner = await start_site(app, config.server.host, config.server.port, reuse_port=reuse_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    log.info(
        "llm-gateway pid %d listening on http://%s:%d (%d endpoints)",
        os.getpid(),
        config.server.host,
        config.server.port,
        len(config.endpoints),
    )
    await stop.wait()
    log.info("shutting down")
    await runner.cleanup()


def _worker_main(config: GatewayConfig, log_level: str) -> None:
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_uvloop()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve_one(config, reuse_port=True))


def serve(config: GatewayConfig) -> None:
    if config.server.workers == 1:
        install_uvloop()
        asyncio.run(_serve_one(config, reuse_port=False))
        return
    context = multiprocessing.get_context("spawn")
    workers = [
        context.Process(target=_worker_main, args=(config, config.log_level), name=f"gateway-worker-{i}")
        for i in range(config.server.workers)
    ]
    for worker in workers:
        worker.start()

    def forward(signum: int, _frame: object) -> None:
        for worker in workers:
            if worker.is_alive() and worker.pid is not None:
                os.kill(worker.pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    for worker in workers:
        worker.join()
