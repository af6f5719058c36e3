"""Load runner: drives a :class:`~loadtest.workloads.Workload` against a target.

Design notes (why it looks like this):

* One shared ``aiohttp.ClientSession`` whose connector limit equals the number
  of requests allowed in flight, so the client never hides a queue of its own
  in front of the target (that would bias latencies: coordinated omission).
* Everything is a *session chain*: a chain sends its first item, then follows
  ``workload.next_turn`` until it returns ``None``.  Single-shot workloads are
  chains of length one; multi-turn users are sequential by construction.
* Open-loop starts chains at seeded Poisson times (``rate=inf`` starts all at
  once); closed-loop keeps ``concurrency`` chains busy.  Both are bounded by
  ``max_requests`` and an overall ``deadline_s``.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import aiohttp

from loadtest.harness import sse
from loadtest.harness.load import Budget, closed_loop, open_loop
from loadtest.harness.scrape import ReplicaStats, fetch_metrics, normalize_url, replica_deltas, snapshot
from loadtest.harness.scrape import sum_samples as _sum_samples  # noqa: F401  (tests use the old name)
from loadtest.harness.sse import ENDPOINT_HEADER, Exchange
from loadtest.workloads import WorkItem, Workload

__all__ = [
    "ENDPOINT_HEADER",
    "BenchResult",
    "DirectRoundRobinTarget",
    "GatewayTarget",
    "ReplicaStats",
    "RequestRecord",
    "Target",
    "fetch_metrics",
    "run_benchmark",
]

_ERROR_TEXT_LIMIT = 500


# --------------------------------------------------------------------------- targets


class Target(Protocol):
    """Where requests go; ``base_url_for`` may rotate (client-side balancing)."""

    label: str
    replica_urls: list[str]

    def base_url_for(self, item: WorkItem) -> str: ...


class GatewayTarget:
    """A single base URL: the gateway, a peer router, or one replica."""

    def __init__(self, base_url: str, label: str | None = None) -> None:
        self.base_url = normalize_url(base_url)
        self.label = label or f"gateway {self.base_url}"
        self.replica_urls: list[str] = []

    def base_url_for(self, item: WorkItem) -> str:
        return self.base_url


class DirectRoundRobinTarget:
    """Baseline: the client spreads requests round-robin over replicas, no proxy."""

    def __init__(self, urls: list[str], label: str | None = None) -> None:
        if not urls:
            raise ValueError("DirectRoundRobinTarget needs at least one URL")
        self.replica_urls = [normalize_url(u) for u in urls]
        self.label = label or f"direct-rr x{len(self.replica_urls)}"
        self._cycle = itertools.cycle(self.replica_urls)

    def base_url_for(self, item: WorkItem) -> str:
        return next(self._cycle)


# --------------------------------------------------------------------------- records


@dataclass(slots=True)
class RequestRecord:
    """Client-side measurements of one request; times in seconds."""

    index: int
    start: float  # relative to benchmark start
    kind: str
    session_id: str | None = None
    group: int | None = None
    turn: int = 0
    priority: str | None = None
    status: int = 0  # HTTP status, 0 when no response arrived
    error: str | None = None
    endpoint: str | None = None
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    e2e: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    answer_chars: int = 0

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


@dataclass
class BenchResult:
    """Everything a report needs; round-trips through JSON."""

    name: str
    workload: str
    workload_params: dict[str, Any]
    target: str
    mode: str  # "open" | "closed"
    rate: float | None
    concurrency: int | None
    started_at: float
    duration_s: float
    records: list[RequestRecord]
    replica_stats: list[ReplicaStats] = field(default_factory=list)
    stopped_by: str = "completed"  # "completed" | "max_requests" | "deadline"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if data["rate"] is not None and math.isinf(data["rate"]):
            data["rate"] = "inf"
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchResult:
        data = dict(data)
        data.pop("summary", None)
        if data.get("rate") == "inf":
            data["rate"] = math.inf
        data["records"] = [RequestRecord(**r) for r in data.get("records", [])]
        data["replica_stats"] = [ReplicaStats(**r) for r in data.get("replica_stats", [])]
        return cls(**data)


# --------------------------------------------------------------------------- one request


async def _send(
    session: aiohttp.ClientSession, base_url: str, item: WorkItem, rec: RequestRecord, t0: float, sent: float
) -> str:
    """Stream one request into ``rec``; return the generated text (for next turns)."""
    rec.start = sent - t0
    ex = Exchange(endpoint=base_url)
    try:
        # require_done=False: a stream that just ends counts, as it always has here.
        await sse.send(session, base_url + item.path, item.body, item.headers, kind=item.kind, sent=sent,
                       require_done=False, error_chars=_ERROR_TEXT_LIMIT, out=ex)  # fmt: skip
    finally:
        _fill(rec, ex)
    return ex.text if rec.ok else ""


def _fill(rec: RequestRecord, ex: Exchange) -> None:
    rec.status, rec.endpoint = ex.status, ex.endpoint
    rec.error = None if ex.ok else ex.error
    rec.ttft, rec.itls, rec.e2e = ex.ttft, ex.itls, ex.latency
    usage = ex.usage or {}
    rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    rec.completion_tokens = int(usage.get("completion_tokens") or 0) or ex.content_chunks
    rec.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    rec.answer_chars = len(ex.text)


# --------------------------------------------------------------------------- driver


class _Run:
    def __init__(
        self, workload: Workload, target: Target, session: aiohttp.ClientSession, budget: Budget, on_done: Any
    ) -> None:
        self.workload = workload
        self.target = target
        self.session = session
        self.budget = budget
        self.on_done = on_done
        self.records: list[RequestRecord] = []

    async def chain(self, first: WorkItem) -> None:
        """A session: its first item, then ``workload.next_turn`` until None (or the budget)."""
        item: WorkItem | None = first
        while item is not None and (sent := self.budget.take()) is not None:
            rec = RequestRecord(len(self.records), 0.0, item.kind, item.session_id, item.group, item.turn,
                                item.priority)  # fmt: skip
            self.records.append(rec)
            try:
                base_url = self.target.base_url_for(item)
                answer = await _send(self.session, base_url, item, rec, self.budget.t0, sent)
            finally:
                self.on_done()
            item = self.workload.next_turn(item, answer) if rec.ok else None

    async def open_loop(
        self, items: Iterator[WorkItem], rate: float, cap: int | None, rng: random.Random
    ) -> None:
        sem = asyncio.Semaphore(cap) if cap else None

        async def capped(first: WorkItem) -> None:
            async with sem if sem is not None else nullcontext():
                await self.chain(first)

        def work(_scheduled_at: float) -> Any:
            first = next(items, None)
            return None if first is None else capped(first)

        await open_loop(work, rate=rate, budget=self.budget, rng=rng)

    async def drive(self, rate: float | None, concurrency: int | None, arrivals: random.Random) -> None:
        """Open loop when ``rate`` is given (``concurrency`` caps it), else closed; to the deadline."""
        items = iter(self.workload.items())
        if rate is not None:
            coro = self.open_loop(items, rate, concurrency, arrivals)
        else:
            assert concurrency is not None
            coro = closed_loop(items, self.chain, concurrency=concurrency, budget=self.budget)
        try:
            await asyncio.wait_for(coro, timeout=self.budget.deadline - time.perf_counter())
        except TimeoutError:
            self.budget.stopped_by = "deadline"


def _progress(enabled: bool) -> Any:
    if not enabled:
        return nullcontext(None)
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        transient=False,
    )


def _check(rate: float | None, concurrency: int | None, max_requests: int, deadline_s: float) -> None:
    if rate is None and concurrency is None:
        raise ValueError("give rate (open-loop) and/or concurrency (closed-loop)")
    if rate is not None and not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate!r}")
    if concurrency is not None and concurrency <= 0:
        raise ValueError(f"concurrency must be > 0, got {concurrency!r}")
    if max_requests <= 0 or deadline_s <= 0:
        raise ValueError("max_requests and deadline_s must be > 0")


async def run_benchmark(
    workload: Workload,
    target: Target,
    *,
    rate: float | None = None,
    concurrency: int | None = None,
    max_requests: int,
    deadline_s: float,
    replica_urls: list[str] | None = None,
    progress: bool = True,
    name: str | None = None,
    seed: int | None = None,
    connection_limit: int | None = None,
) -> BenchResult:
    """Run ``workload`` against ``target`` and collect per-request records.

    ``rate`` (req/s, ``math.inf`` = all at once) selects open-loop Poisson
    arrivals of new sessions, optionally capped at ``concurrency`` sessions in
    flight; ``concurrency`` alone selects closed-loop.  ``replica_urls``
    defaults to the target's replicas and enables ``/metrics`` deltas.
    """
    _check(rate, concurrency, max_requests, deadline_s)
    scrape = list(replica_urls if replica_urls is not None else target.replica_urls)
    total = min(max_requests, workload.total_requests)
    # Never queue inside the client: allow as many connections as requests may be in flight.
    limit = connection_limit if connection_limit is not None else (concurrency or 0)
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    started_at = time.time()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        before = await snapshot(session, scrape) if scrape else {}
        with _progress(progress) as bar:
            task_id = bar.add_task(name or target.label, total=total) if bar is not None else None

            def on_done() -> None:
                if bar is not None and task_id is not None:
                    bar.advance(task_id)

            budget = Budget(deadline_s, max_requests)
            run = _Run(workload, target, session, budget, on_done)
            arrivals = random.Random(f"{workload.seed if seed is None else seed}/arrivals")
            await run.drive(rate, concurrency, arrivals)
            duration = time.perf_counter() - budget.t0
        after = await snapshot(session, scrape) if scrape else {}

    return BenchResult(
        name=name or f"{workload.name} @ {target.label}",
        workload=workload.name,
        workload_params=workload.params(),
        target=target.label,
        mode="open" if rate is not None else "closed",
        rate=rate,
        concurrency=concurrency,
        started_at=started_at,
        duration_s=duration,
        records=run.records,
        replica_stats=replica_deltas(before, after),
        stopped_by=budget.stopped_by,
    )
