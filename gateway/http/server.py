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
import logging
import multiprocessing
import os
import secrets
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from aiohttp import web

from gateway.config import ConfigError, GatewayConfig, ServerConfig, load_config
from gateway.fleet.worker_table import WorkerTable, create_table
from gateway.http.app import build_app
from gateway.http.connections import ClientGuard, GuardedRunner, connection_cap
from gateway.http.middleware import IN_FLIGHT, InFlight, remember_response
from gateway.http.reload import ConfigReloader
from gateway.http.state import STATE, GatewayState
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
_RESPAWN_WINDOW_S = 60.0  # a worker's exits this recent count towards its next delay
_RESPAWN_DELAYS_S = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0)  # by its exits in the window
_WAIT_SLICE_S = 0.2  # the parent looks at its stop flag at least this often while a respawn waits


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
    if on_listening is not None:
        on_listening()
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
    in_flight = sum(e.in_flight for e in state.registry.targets())
    log.info("shutting down: not ready; draining %.1f s (%d requests in flight)", server.drain_s, in_flight)
    await asyncio.sleep(state.config.server.drain_s)
    for task in tasks:
        task.cancel()
    await _stop_site(runner, app[IN_FLIGHT], server.shutdown_timeout_s)
    log.info("stopped")


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
    started: Connection | None = None,
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
        return _supervise(
            config, reload, [WorkerSlot(i, directory, spec) for i in range(config.server.workers)]
        )
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@dataclass
class _Worker:
    """One running worker process: its slot, and whether it ever started serving."""

    slot: WorkerSlot
    process: multiprocessing.process.BaseProcess
    started: Connection  # the worker writes one byte here once its listener is up

    def served(self) -> bool:
        """Whether it ever listened (read after it exited; a pipe, not an Event: no resource tracker)."""
        try:  # poll() is also true at EOF (the worker died before it wrote): read the byte
            return self.started.poll() and self.started.recv_bytes() == b"1"
        except (OSError, EOFError):
            return False


@dataclass
class _Respawns:
    """When each slot's worker died lately, so a worker that keeps dying is started ever slower."""

    exits: dict[int, list[float]] = field(default_factory=dict)

    def delay_after_exit(self, index: int, now: float) -> float:
        recent = [t for t in self.exits.get(index, []) if now - t < _RESPAWN_WINDOW_S] + [now]
        self.exits[index] = recent
        return _RESPAWN_DELAYS_S[min(len(recent), len(_RESPAWN_DELAYS_S)) - 1]


def _supervise(config: GatewayConfig, reload: ReloadSource | None, slots: list[WorkerSlot]) -> int:
    """Start the workers, forward signals to them, clear the shared cells of each that exits,
    and start a dead worker again; the exit status: 0 after a requested stop that every worker
    ended cleanly (a worker that died before it and was started again does not count), else 1.

    A worker that dies (killed, crashed, OOM) leaves the others serving; its in-flight counts and
    its half-open probes are taken out of the table at once, so no endpoint stays loaded by
    requests nobody is running any more. It is then started again in the same slot (at once,
    then slower while it keeps dying: ``_RESPAWN_DELAYS_S``) with the config as it is now (the
    file re-read, as a reload would), so the gateway does not run on fewer cores for good. A
    worker that exits on its own before it ever served (a taken port, a bad config: exit status
    1) is not started again: it would fail the same way; when every worker has, the gateway
    exits 1. One killed by a signal while it started is started again.
    """
    context = multiprocessing.get_context("spawn")
    parent = os.getpid()
    stopping = False

    def start(slot: WorkerSlot, worker_config: GatewayConfig) -> _Worker:
        started, tell_started = context.Pipe(duplex=False)
        process = context.Process(
            target=_worker_main,
            args=(worker_config, worker_config.log_level, reload, slot, parent, tell_started),
            name=f"gateway-worker-{slot.index}",
        )
        process.start()
        tell_started.close()  # the worker's end
        return _Worker(slot, process, started)

    running = {w.process.sentinel: w for w in (start(slot, config) for slot in slots)}
    due: dict[int, tuple[float, WorkerSlot]] = {}  # slot index -> (when, slot) of a respawn to come
    respawns = _Respawns()

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = stopping or signum != signal.SIGHUP
        for worker in list(running.values()):
            if worker.process.is_alive() and worker.process.pid is not None:
                os.kill(worker.process.pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    table = WorkerTable(slots[0].table, None)
    failed = False
    try:
        while running or (due and not stopping):
            timeout = None  # no respawn waiting: until a worker exits (a signal stops them all)
            if due and not stopping:
                next_due = min(when for when, _ in due.values())
                timeout = min(_WAIT_SLICE_S, max(0.0, next_due - time.monotonic()))
            for sentinel in wait(list(running), timeout=timeout):
                worker = running.pop(sentinel)
                worker.process.join()
                slot = worker.slot
                table.clear_worker(slot.index)
                served = worker.served()
                worker.started.close()
                if stopping:
                    failed = failed or worker.process.exitcode != 0
                    continue
                if not served and (worker.process.exitcode or 0) >= 0:
                    failed = True
                    log.error(
                        "worker %d (pid %s) exited with %s before it served; not started again",
                        slot.index,
                        worker.process.pid,
                        worker.process.exitcode,
                    )
                    continue
                delay = respawns.delay_after_exit(slot.index, time.monotonic())
                due[slot.index] = (time.monotonic() + delay, slot)
                log.warning(
                    "worker %d (pid %s) exited with %s; its shared load counts were cleared; "
                    "starting it again in %.1f s",
                    slot.index,
                    worker.process.pid,
                    worker.process.exitcode,
                    delay,
                )
            if stopping:
                due.clear()
            now = time.monotonic()
            for index, (when, slot) in list(due.items()):
                if when <= now:
                    del due[index]
                    again = dataclasses.replace(slot, respawns=slot.respawns + 1)
                    worker = start(again, _config_now(config, reload))
                    running[worker.process.sentinel] = worker
                    log.warning("worker %d started again (pid %s)", index, worker.process.pid)
                    if stopping and worker.process.pid is not None:  # the stop came while it started
                        os.kill(worker.process.pid, signal.SIGTERM)
    finally:
        table.close()
    if not stopping:  # every worker gone with nobody asking: a failure (a taken port …)
        log.error("every worker has exited without a stop signal")
        return 1
    return 1 if failed else 0


def _config_now(config: GatewayConfig, reload: ReloadSource | None) -> GatewayConfig:
    """The config a worker started again gets: the file as it is now, as its siblings reloaded
    it; the ``server`` section stays the one the gateway started with (its port, its workers:
    a reload does not move them either). A file that no longer loads: the start config."""
    if reload is None:
        return config
    try:
        now = load_config(reload.path, overrides=reload.overrides)
    except (ConfigError, OSError) as exc:
        log.error("config file not loadable for a restarted worker; it starts with the start config: %s", exc)
        return config
    return now.model_copy(update={"server": config.server})
