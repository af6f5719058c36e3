"""Steady open-loop load with one outcome record per request (fault runs, the soak).

Bounded: every request has its own timeout, so draining ends ``request_timeout_s`` after
the last arrival at the latest. No connection limit in the client, so it never queues in
front of the gateway (no coordinated omission). Records are appended as requests start,
so a concurrent task (a fault injector) can watch them.
"""

from __future__ import annotations

import math
import random
from collections.abc import Awaitable
from dataclasses import dataclass

import aiohttp

from loadtest.harness import sse
from loadtest.harness.load import Budget, open_loop
from loadtest.workloads import WorkItem, Workload

__all__ = ["LoadRun", "RequestOutcome", "run_load"]


@dataclass(slots=True)
class RequestOutcome:
    """What the client saw; times in seconds relative to the load's start."""

    index: int
    start: float
    kind: str
    stream: bool
    session_id: str | None = None
    priority: str | None = None
    endpoint: str | None = None  # x-gateway-endpoint of the attempt that answered
    status: int = 0  # HTTP status, 0 when none arrived
    # ok | http_<status> | stream_error (in-band SSE error) | truncated | timeout | connection | bad_payload
    outcome: str = "pending"
    events: int = 0  # SSE data events that reached the client (a chat stream opens with a role-only one)
    streamed: bool = False  # >= 1 content chunk reached the client before the end
    ttft: float | None = None
    latency: float | None = None
    error: str | None = None
    # How late the client sent it against its Poisson schedule: large values mean the
    # benchmark process itself was starved of CPU, and latencies around then are suspect.
    send_lag: float = 0.0

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"

    def fill(self, ex: sse.Exchange) -> None:
        self.status, self.endpoint, self.outcome, self.error = ex.status, ex.endpoint, ex.outcome, ex.error
        self.events, self.streamed = ex.events, bool(ex.content_chunks)
        self.ttft, self.latency = ex.ttft, ex.latency


@dataclass
class LoadRun:
    records: list[RequestOutcome]
    t0: float  # perf_counter() at the load's start: every record time is relative to it
    load_s: float  # how long new requests were started


async def run_load(
    base_url: str,
    workload: Workload,
    *,
    rate: float,
    duration_s: float,
    max_requests: int | None = None,
    request_timeout_s: float = 10.0,
    seed: int = 0,
    t0: float | None = None,
    records: list[RequestOutcome] | None = None,
) -> LoadRun:
    """Open-loop Poisson arrivals of ``workload.items()`` for ``duration_s`` (and at most
    ``max_requests``), then drain; every answer goes back through ``workload.next_turn``."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError("rate and duration_s must be > 0")
    cap = max_requests if max_requests is not None else math.ceil(rate * duration_s * 2)
    budget = Budget(duration_s, cap, t0)
    records = [] if records is None else records
    items = iter(workload.items())
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(item: WorkItem, rec: RequestOutcome, sent: float) -> None:
            ex = await sse.send(session, base_url + item.path, item.body, item.headers, kind=item.kind,
                                sent=sent, timeout_s=request_timeout_s)  # fmt: skip
            rec.fill(ex)
            if ex.ok:
                workload.next_turn(item, ex.text)

        def work(scheduled_at: float) -> Awaitable[None] | None:
            item = next(items, None)
            sent = budget.take() if item is not None else None
            if item is None or sent is None:  # the request's start is the instant take() allowed it
                return None
            rec = RequestOutcome(len(records), sent - budget.t0, item.kind, item.stream, item.session_id,
                                 item.priority, send_lag=max(0.0, sent - scheduled_at))  # fmt: skip
            records.append(rec)
            return one(item, rec, sent)

        load_s = await open_loop(work, rate=rate, budget=budget, rng=random.Random(f"{seed}/arrivals"))
    return LoadRun(records, budget.t0, load_s)
