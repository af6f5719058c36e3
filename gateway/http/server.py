"""Runs the gateway: one process, or several sharing the port through SO_REUSEPORT.

With several workers each process has its own endpoint view, scrapers and in-flight
counts (and its own /metrics); the kernel spreads connections across them.

Signals: SIGTERM/SIGINT start a graceful shutdown — ``/ready`` turns 503 at once,
the listener stays open for ``server.drain_s`` so load balancers notice, then it
closes and in-flight requests (streams included) get up to
``server.shutdown_timeout_s`` to finish; a second signal stops at once. SIGHUP
reloads the config file (also reloaded when its content changes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from gateway.config import ConfigError, GatewayConfig
from gateway.http.app import build_app
from gateway.http.reload import ConfigReloader
from gateway.http.state import STATE, GatewayState

__all__ = ["ReloadSource", "install_uvloop", "serve", "start_site"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReloadSource:
    """Where the running config came from, so it can be read again."""

    path: Path
    overrides: dict[str, Any] = field(default_factory=dict)
    watch_interval_s: float = 2.0


def install_uvloop() -> bool:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a core dependency on Linux
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


async def start_site(
    app: web.Application,
    host: str,
    port: int,
    *,
    reuse_port: bool = False,
    shutdown_timeout_s: float = 30.0,
    max_header_bytes: int = 8190,
    max_headers: int = 64,
) -> web.AppRunner:
    """Start ``app`` on host:port; ``handler_cancellation`` makes a client disconnect cancel the handler."""
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=shutdown_timeout_s,
        max_line_size=max_header_bytes,
        max_field_size=max_header_bytes,
        max_headers=max_headers,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_port=reuse_port, backlog=2048)
    await site.start()
    return runner


async def _serve_one(config: GatewayConfig, reuse_port: bool, reload: ReloadSource | None) -> None:
    app = build_app(config)
    server = config.server
    runner = await start_site(
        app,
        server.host,
        server.port,
        reuse_port=reuse_port,
        shutdown_timeout_s=server.shutdown_timeout_s,
        max_header_bytes=server.max_header_bytes,
        max_headers=server.max_headers,
    )
    state = app[STATE]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task[None]] = []

    def on_stop_signal() -> None:
        if stop.is_set():
            log.warning("second stop signal: exiting now")
            os._exit(1)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_stop_signal)
    if reload is not None:
        reloader = ConfigReloader(state, reload.path, reload.overrides)
        loop.add_signal_handler(signal.SIGHUP, reloader.reload_soon)
        tasks.append(asyncio.create_task(reloader.watch(reload.watch_interval_s), name="config-watch"))
    else:  # no file to re-read, but SIGHUP must not kill the process; the keys file still reloads
        loop.add_signal_handler(signal.SIGHUP, lambda: _reload_keys(state))
        if state.auth is not None:
            tasks.append(asyncio.create_task(_watch_keys(state), name="keys-watch"))
    log.info(
        "llm-gateway pid %d listening on http://%s:%d (%d endpoints)",
        os.getpid(),
        server.host,
        server.port,
        len(config.endpoints),
    )
    await stop.wait()
    state.shutting_down = True
    in_flight = sum(e.in_flight for e in state.registry)
    log.info("shutting down: not ready; draining %.1f s (%d requests in flight)", server.drain_s, in_flight)
    await asyncio.sleep(state.config.server.drain_s)
    for task in tasks:
        task.cancel()
    await runner.cleanup()  # stops accepting, waits for in-flight handlers up to shutdown_timeout_s
    log.info("stopped")


def _reload_keys(state: GatewayState) -> None:
    if state.auth is None:
        log.info("SIGHUP: started without --config and without auth: nothing to reload")
        return
    try:
        state.auth.reconfigure(state.config.auth)
        log.warning("SIGHUP: API keys reloaded")
    except ConfigError as exc:
        log.error("SIGHUP: keys file rejected, the previous keys stay: %s", exc)


async def _watch_keys(state: GatewayState, interval_s: float = 2.0) -> None:
    while True:
        await asyncio.sleep(interval_s)
        state.auth.reload_keys_if_changed()


def _worker_main(config: GatewayConfig, log_level: str, reload: ReloadSource | None) -> None:
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_uvloop()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve_one(config, reuse_port=True, reload=reload))


def serve(config: GatewayConfig, reload: ReloadSource | None = None) -> None:
    if config.server.workers == 1:
        install_uvloop()
        asyncio.run(_serve_one(config, reuse_port=False, reload=reload))
        return
    context = multiprocessing.get_context("spawn")
    workers = [
        context.Process(
            target=_worker_main, args=(config, config.log_level, reload), name=f"gateway-worker-{i}"
        )
        for i in range(config.server.workers)
    ]
    for worker in workers:
        worker.start()

    def forward(signum: int, _frame: object) -> None:
        for worker in workers:
            if worker.is_alive() and worker.pid is not None:
                os.kill(worker.pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    for worker in workers:
        worker.join()
