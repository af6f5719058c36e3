"""What one worker of a multi-worker gateway shares with its siblings, wired in one place.

``serve`` (the parent) creates a directory holding the shared load table and hands each
worker a :class:`WorkerSlot`; ``build_app`` calls :func:`attach_worker` with it. With one
worker there is no slot and none of this exists: the single process keeps today's path.

Shared: per-endpoint in-flight requests, in-flight prompt tokens and pending prefill tokens
(:class:`~gateway.fleet.shared_load.SharedLoad`); with the memory prefix index, what each
worker records (:class:`~gateway.prefix.broadcast.BroadcastPrefixIndex`; the Redis index
and the exact index from KV events are shared already); with the memory session store, the
session pins (:class:`~gateway.sessions.session_broadcast.BroadcastSessionStore`) and the
Responses API's records (:class:`~gateway.sessions.response_broadcast.BroadcastResponseStore`);
breaker states
(:class:`~gateway.proxy.shared_breakers.SharedBreakerStates`); admin API changes
(:class:`~gateway.http.admin_share.AdminShare`); ``/metrics`` answers with every worker's
series (:class:`~gateway.http.metrics_share.MetricsShare`). Every response names the worker that
served it (``x-gateway-worker: <pid>``), so an operator — or a test — can tell them apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from gateway.fleet.shared_load import SharedLoad
from gateway.fleet.worker_table import TableSpec, WorkerTable
from gateway.http.admin_share import AdminShare
from gateway.http.metrics_share import MetricsShare
from gateway.http.state import GatewayState
from gateway.ops.tasks import supervise
from gateway.prefix.broadcast import BroadcastPrefixIndex, PrefixBus
from gateway.prefix.memory import MemoryPrefixIndex
from gateway.proxy.shared_breakers import SharedBreakerStates
from gateway.sessions.response_broadcast import BroadcastResponseStore
from gateway.sessions.responses import MemoryResponseStore
from gateway.sessions.session_broadcast import BroadcastSessionStore
from gateway.sessions.store import MemorySessionStore

__all__ = ["STATUS_FILE", "WORKER_HEADER", "WorkerSlot", "WorkersStatus", "attach_worker"]

WORKER_HEADER = "x-gateway-worker"
STATUS_FILE = "workers.json"  # the parent's count of its workers (gateway.http.supervisor writes it)
_IDLE_REFRESH_S = 0.05  # sums refreshed this often without traffic (/metrics, scrapes, queue wakes)
_BEAT_S = 1.0  # a worker's heartbeat, at most this far apart (a quarter of worker_timeout_s if shorter)


@dataclass(frozen=True, slots=True)
class WorkerSlot:
    """Which worker this process is, and where the shared state lives (made by the parent)."""

    index: int
    directory: str
    table: TableSpec
    respawns: int = 0  # times this slot's worker was started again after its process died


def attach_worker(app: web.Application, state: GatewayState, slot: WorkerSlot) -> None:
    table = WorkerTable(slot.table, slot.index)
    timeout_s = state.config.server.worker_timeout_s
    state.metrics.registry.register(WorkersStatus(slot.directory))
    full = Counter(
        "llm_gateway_worker_table_full",
        "Endpoints the shared worker table had no row for (counted by one worker only)",
        registry=state.metrics.registry,
    )
    shared = SharedLoad(table, state.registry, on_full=lambda _name: full.inc())
    state.shared_load = shared
    state.breakers.shared = SharedBreakerStates(shared)
    shared.refresh(force=True)
    index = _share_prefix_records(state, slot)
    responses = _share_response_records(state, slot)
    pins = _share_session_pins(state, slot)
    admin = state.admin_share = AdminShare(state, slot.directory, slot.index, slot.table.workers)
    metrics = state.metrics_share = MetricsShare(
        state.metrics.registry, slot.directory, slot.index, slot.table.workers
    )
    pid = str(os.getpid())

    async def name_worker(_request: web.Request, response: web.StreamResponse) -> None:
        response.headers[WORKER_HEADER] = pid

    async def lifetime(_app: web.Application) -> AsyncIterator[None]:
        if index is not None:
            index.start()
        if responses is not None:
            responses.start(catch_up=slot.respawns > 0)
        if pins is not None:
            pins.start(catch_up=slot.respawns > 0)
        admin.listen()
        await metrics.start()
        restarts = state.metrics.task_restarts

        def background(name: str, run: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
            supervised = supervise(name, run, on_crash=lambda n: restarts.labels(n).inc())
            return asyncio.create_task(supervised, name=name)

        tasks = [background("worker-share-refresh", lambda: _refresh_while_idle(shared))]
        if timeout_s > 0:
            tasks.append(background("worker-heartbeat", lambda: _beat(table, min(_BEAT_S, timeout_s / 4))))
        yield
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        admin.close()
        await metrics.close()
        shared.close()
        table.close()
        if index is not None:
            await index.close()
        if responses is not None:
            await responses.close()
        if pins is not None:
            await pins.close()

    app.on_response_prepare.append(name_worker)
    app.cleanup_ctx.append(lifetime)


def _dropped(state: GatewayState, what: str) -> Callable[[], None]:
    """The counter of ``what`` a sibling did not get (its buffer was full, or it was gone)."""
    return Counter(
        f"llm_gateway_worker_{what}_records_dropped",
        f"{what} records broadcast to a sibling worker, not delivered (its buffer was full, or it was gone)",
        registry=state.metrics.registry,
    ).inc


def _share_prefix_records(state: GatewayState, slot: WorkerSlot) -> BroadcastPrefixIndex | None:
    local = state.prefix.index
    if not isinstance(local, MemoryPrefixIndex):  # Redis: every worker reads the same index
        return None
    bus = PrefixBus(slot.directory, slot.index, slot.table.workers, on_drop=_dropped(state, "prefix"))
    index = state.prefix.index = BroadcastPrefixIndex(local, bus)
    return index


def _share_response_records(state: GatewayState, slot: WorkerSlot) -> BroadcastResponseStore | None:
    """With the memory store: a Responses chain continues through any worker (with auth on,
    an id a worker does not know is never looked for on the replicas)."""
    local = state.sessions.responses
    if not isinstance(local, MemoryResponseStore):  # Redis: every worker reads the same store
        return None
    workers = slot.table.workers
    store = BroadcastResponseStore(local, slot.directory, slot.index, workers, _dropped(state, "response"))
    state.sessions.responses = store
    return store


def _share_session_pins(state: GatewayState, slot: WorkerSlot) -> BroadcastSessionStore | None:
    """With the memory store: a session moved by one worker is found moved by the others."""
    sessions = state.sessions
    if not isinstance(sessions.store, MemorySessionStore):  # Redis: every worker reads the same pins
        return None
    store = BroadcastSessionStore(
        sessions.store,
        sessions.placement,
        slot.directory,
        slot.index,
        slot.table.workers,
        _dropped(state, "session"),
    )
    sessions.store = store
    return store


class WorkersStatus:
    """The parent's view of its workers, read at scrape time from the file it keeps
    (``gateway.http.supervisor``): every worker exports the same numbers, so take ``max``
    over ``worker``. A slot whose replacement keeps dying has no worker of its own to say so."""

    def __init__(self, directory: str) -> None:
        self._path = os.path.join(directory, STATUS_FILE)

    def collect(self) -> Iterator[Metric]:
        try:
            with open(self._path) as file:
                status = json.load(file)
            configured, listening = int(status["configured"]), int(status["listening"])
            respawns = [int(n) for n in status["respawns"]]
            hangs = [int(n) for n in status["hangs"]]
        except (OSError, ValueError, KeyError, TypeError):  # not written yet, or the parent gone
            return
        yield GaugeMetricFamily(
            "llm_gateway_workers_configured", "Worker processes the gateway runs (server.workers)", configured
        )
        yield GaugeMetricFamily(
            "llm_gateway_workers_listening", "Worker processes serving, by the parent's count", listening
        )
        started_again = CounterMetricFamily(
            "llm_gateway_worker_respawns",
            "Times a worker slot's process was started again after it died",
            labels=["slot"],
        )
        for index, count in enumerate(respawns):
            started_again.add_metric([str(index)], count)
        yield started_again
        killed = CounterMetricFamily(
            "llm_gateway_worker_hangs",
            "Times a worker slot's process was killed because its event loop stopped running"
            " (server.worker_timeout_s); each is then started again",
            labels=["slot"],
        )
        for index, count in enumerate(hangs):
            killed.add_metric([str(index)], count)
        yield killed


async def _beat(table: WorkerTable, interval_s: float) -> None:
    """Tell the parent this worker's event loop runs (``server.worker_timeout_s``): a loop that
    is blocked, or a process that is stopped, beats no more and is killed and replaced."""
    while True:
        table.beat(time.monotonic())
        await asyncio.sleep(interval_s)


async def _refresh_while_idle(shared: SharedLoad) -> None:
    while True:
        await asyncio.sleep(_IDLE_REFRESH_S)
        shared.refresh(force=True)
