"""Runs the gateway: one process, or several sharing the port through SO_REUSEPORT.

With several workers each process has its own endpoint objects and scrapers (and its own
/metrics); the kernel spreads connections across them. Their load on each endpoint is
shared through a table the parent creates before spawning them (``gateway.http.workers``),
and the parent clears a dead worker's part of it.

Signals: SIGTERM/SIGINT start a graceful shutdown — ``/ready`` turns 503 at once,
the listener stays open for ``server.drain_s`` so load balancers notice, then it
closes and in-flight requests (streams included) get up to
``server.shutdown_timeout_s`` to finish — what is still running then is ended by the
gateway (a stream with an SSE error event and ``data: [DONE]``, see ``_stop_site``); a
second signal stops at once. SIGHUP reloads the config file (also reloaded when its
content changes).

Client connections are served by :mod:`gateway.http.connections` (header, body and
keep-alive deadlines, a connection cap).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import gc
import logging
import os
import secrets
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from gateway.config import ConfigError, GatewayConfig, ServerConfig
from gateway.fleet.worker_table import create_table
from gateway.http.app import build_app
from gateway.http.connections import ClientGuard, GuardedRunner, connection_cap
from gateway.http.middleware import IN_FLIGHT, InFlight, remember_response
from gateway.http.reload import ConfigReloader
from gateway.http.state import STATE, GatewayState
from gateway.http.supervisor import publish_config, supervise
from gateway.http.workers import WorkerSlot

__all__ = [
    "ReloadSource",
    "install_uvloop",
    "serve",
    "shared_worker_config",
    "start_site",
]

log = logging.getLogger(__name__)
_AIOHTTP_SHUTDOWN_GRACE_S = 2.0  # after our own shutdown deadline
_REPEAT_WINDOW_S = 1.0  # a stop signal again within this is the same stop delivered twice
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ReloadSource:
    """Where the running config came from, so it can be read again."""

    path: Path
    overrides: dict[str, Any] = field(default_factory=dict)
    watch_interval_s: float = 2.0
    digest: bytes | None = None  # of the file the running config came from (None: read it at start)


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
    """Start ``app`` on host:port; ``handler_cancellation`` makes a client disconnect cancel the handler.

    The client timeouts and the connection cap come from the app's ``server`` config
    (``header_timeout_s``, ``body_timeout_s``, ``keepalive_timeout_s``, ``max_connections``),
    so every way of starting the gateway (``serve``, the test harness) applies them.
    """
    server = app[STATE].config.server if STATE in app else ServerConfig()
    guard = ClientGuard(
        server.header_timeout_s, server.body_timeout_s, connection_cap(server.max_connections)
    )
    app[IN_FLIGHT] = InFlight()
    app.on_response_prepare.append(remember_response)
    runner = GuardedRunner(
        app,
        guard,
        handler_cancellation=True,
        access_log=None,
        # aiohttp's own deadline must come well after ours (see _stop_site): at the same instant
        # its timeout cancels the waiter our ended handler is about to resolve (InvalidStateError)
        shutdown_timeout=shutdown_timeout_s + _AIOHTTP_SHUTDOWN_GRACE_S,
        keepalive_timeout=server.keepalive_timeout_s,
        max_line_size=max_header_bytes,
        max_field_size=max_header_bytes,
        max_headers=max_headers,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_port=reuse_port, backlog=2048)
    await site.start()
    return runner


async def _serve_one(
    config: GatewayConfig,
    reuse_port: bool,
    reload: ReloadSource | None,
    worker: WorkerSlot | None = None,
    on_listening: Callable[[], object] | None = None,
) -> None:
    app = build_app(config, worker=worker)
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

    first_stop_at: float | None = None

    def on_stop_signal() -> None:
        nonlocal first_stop_at
        now = time.monotonic()
        if first_stop_at is None:
            first_stop_at = now
            stop.set()
        elif now - first_stop_at >= _REPEAT_WINDOW_S:
            log.warning("second stop signal: exiting now")
            os._exit(1)
        # else: the same stop delivered twice (to the whole process group or cgroup, and
        # forwarded by the parent): one drain, not an abrupt exit

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_stop_signal)
    if reload is not None:
        publish = None
        if worker is not None:  # what this worker runs, for a replacement of any worker

            def publish() -> None:
                publish_config(worker.directory, worker.index, state.config, reloader.digest)

        reloader = ConfigReloader(state, reload.path, reload.overrides, reload.digest, on_applied=publish)
        loop.add_signal_handler(signal.SIGHUP, reloader.reload_soon)
        tasks.append(asyncio.create_task(reloader.watch(reload.watch_interval_s), name="config-watch"))
        if publish is not None and worker.respawns == 0:
            # A replacement does not: it runs what the newest publication said when it was
            # started, and writing that again could make an older config look newest.
            publish()
    else:  # no file to re-read, but SIGHUP must not kill the process; the keys file still reloads
        loop.add_signal_handler(signal.SIGHUP, lambda: _reload_keys(state))
        if state.auth is not None:
            tasks.append(asyncio.create_task(_watch_keys(state), name="keys-watch"))
    if on_listening is not None:  # now that its signal handlers are in (the parent held them back)
        on_listening()
    log.info(
        "llm-gateway pid %d listening on http://%s:%d (%d endpoints)",
        os.getpid(),
        server.host,
        server.port,
        len(config.endpoints),
    )
    _freeze_startup_objects()
    await stop.wait()
    state.shutting_down = True
    in_flight = sum(e.in_flight for e in state.registry.targets())
    log.info("shutting down: not ready; draining %.1f s (%d requests in flight)", server.drain_s, in_flight)
    await asyncio.sleep(state.config.server.drain_s)
    for task in tasks:
        task.cancel()
    await _stop_site(runner, app[IN_FLIGHT], server.shutdown_timeout_s)
    log.info("stopped")


def _freeze_startup_objects() -> None:
    """Keep what start-up made (modules, the app, its config and plugins: most of the heap) out
    of every later garbage collection. A full collection walks every tracked object; with them it
    held the event loop ~50 ms, about once a second under load (each one, with 64 requests in
    flight, is a 50 ms tail for all of them); frozen, ~1.3 ms. Collected first, so no garbage is
    frozen. What start-up made and later drops is still freed by its reference count."""
    gc.collect()
    gc.freeze()


async def _stop_site(runner: web.AppRunner, in_flight: InFlight, timeout_s: float) -> None:
    """Stop accepting and wait up to ``timeout_s`` for in-flight handlers; then end the rest.

    aiohttp's cleanup waits the same timeout, but what it does then is cancel the handler
    and close the socket at once, so a stream just stops mid-body. Here the handlers still
    running at ``timeout_s`` are cancelled first with a reason: the middleware ends each
    stream with an SSE error event and ``data: [DONE]`` (a request not yet answering gets a
    503), and aiohttp finds them finished. aiohttp's own deadline is
    ``_AIOHTTP_SHUTDOWN_GRACE_S`` later (``start_site``), so ours always comes first and the
    ended handlers have time to write their last event.
    """
    cleanup = asyncio.ensure_future(runner.cleanup())
    done, _ = await asyncio.wait({cleanup}, timeout=timeout_s)
    if not done:
        cut = in_flight.cut(
            f"the gateway is shutting down and this request did not finish within {timeout_s:g} s"
        )
        log.warning("shutdown timeout (%.1f s): ended %d requests still running", timeout_s, cut)
    await cleanup


def _reload_keys(state: GatewayState) -> None:
    if state.auth is None:
        log.info("SIGHUP: started without --config and without auth: nothing to reload")
        return
    try:
        state.auth.reconfigure(state.config.auth)
        log.warning("SIGHUP: API keys reloaded")
    except (ConfigError, ValueError) as exc:
        log.error("SIGHUP: keys file rejected, the previous keys stay: %s", exc)


async def _watch_keys(state: GatewayState, interval_s: float = 2.0) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            state.auth.reload_keys_if_changed()
        except Exception:  # whatever a file half-written gives: the watch goes on, the old keys stay
            log.exception("keys file reload failed; the previous keys stay")


def _worker_main(
    config: GatewayConfig,
    log_level: str,
    reload: ReloadSource | None,
    worker: WorkerSlot,
    parent: int,
    started: Any = None,
) -> None:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until the loop's handler: a reload must not kill
    _die_with_parent(parent)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_uvloop()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(
            _serve_one(
                config,
                reuse_port=True,
                reload=reload,
                worker=worker,
                on_listening=(lambda: started.send_bytes(b"1")) if started is not None else None,
            )
        )


def _die_with_parent(parent: int) -> None:
    """A worker whose parent is gone (SIGKILL, the OOM killer) drains and exits: orphans would
    go on serving the port (SO_REUSEPORT) with nobody clearing their shared counts, next to a
    restarted gateway. Linux's parent-death signal; elsewhere only the check at start."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it died before the signal was armed
        os._exit(1)


def shared_worker_config(
    config: GatewayConfig, reload: ReloadSource | None
) -> tuple[GatewayConfig, ReloadSource | None]:
    """The config every worker gets: one session-token secret, generated here in the parent.

    Each worker would otherwise draw its own random secret, and a token issued by one
    worker would be rejected by the others (the kernel spreads a client's connections
    across workers). The secret also goes into the reload overrides: a re-read file has
    no secret, and without it every reload would see ``sessions`` "changed".
    """
    if config.sessions.token_secret is not None:
        return config, reload
    secret = secrets.token_hex(32)
    sessions = config.sessions.model_copy(update={"token_secret": secret})
    config = config.model_copy(update={"sessions": sessions})
    if reload is not None:
        overrides = dict(reload.overrides)
        overrides["sessions"] = {**overrides.get("sessions", {}), "token_secret": secret}
        reload = dataclasses.replace(reload, overrides=overrides)
    return config, reload


def serve(config: GatewayConfig, reload: ReloadSource | None = None) -> int:
    """Run until stopped; the process's exit status."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until a handler is in: a reload must not kill
    if config.server.workers == 1:
        install_uvloop()
        asyncio.run(_serve_one(config, reuse_port=False, reload=reload))
        return 0
    config, reload = shared_worker_config(config, reload)
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None  # memory-backed where there is one
    directory = tempfile.mkdtemp(prefix="llm-gateway-", dir=shm)
    try:
        spec = create_table(directory, config.server.worker_table_rows, config.server.workers)
        slots = [WorkerSlot(i, directory, spec) for i in range(config.server.workers)]
        return supervise(config, reload, slots, _worker_main)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
