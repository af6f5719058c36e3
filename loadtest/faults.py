"""Reliability benchmark: one replica (or Redis) fails mid-run; what do clients see?

    python -m loadtest.faults [--rate 50] [--duration 60] [--replicas 4] \\
        [--scenarios kill,error,hang,drop,redis] [--json out.json] [--strict]

Every scenario gets a fresh fleet of simulated replicas behind one gateway process and
steady open-loop load (streaming and non-streaming chat, ~50-300 ms each). At
``duration / 3`` the busiest replica is faulted:

- ``kill``: SIGKILL by PID;  ``error``: it answers HTTP 500;  ``hang``: it accepts and
  never answers;  ``drop``: it cuts streams after a few chunks (non-streams at once);
- ``redis``: the gateway keeps its prefix index and sessions in a redis-server this
  module starts; that server is SIGKILLed and restarted on the same port seconds later.

When did the gateway stop sending to the faulted replica? Three witnesses, merged into
one timeline of "an attempt went there": the client's ``x-gateway-endpoint`` headers, the
gateway's ``/metrics`` (per endpoint: answered + failed attempts + in flight, polled every
``--poll`` s, so the resolution is the poll interval) and, while the process lives, the
replica's own ``/admin/state`` (requests that reached its engine). ``last_sent_s`` is the
last attempt after injection; ``ejected_after_s`` is where the first gap of ``--gap`` s
without attempts starts, provided attempts stay that sparse afterwards (so a breaker's
half-open probes do not hide an ejection, and a lull does not fake one). Targets: no failures
of requests that had not started streaming (no content chunk yet: a failure after the
role-only first chunk of a chat stream counts, the response being committed then);
ejection within 2 s; Redis outage: no 5xx.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import math
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

from loadtest.harness.fleet import ManagedProcess, free_ports, start_gateway, start_replicas
from loadtest.report import percentile
from loadtest.runner import ENDPOINT_HEADER
from loadtest.workloads import PRIORITY_CLASSES, pseudo_text

__all__ = [
    "SCENARIOS",
    "SIM_ARGS",
    "GatewayCounters",
    "GatewayWatcher",
    "LoadMix",
    "LoadRequest",
    "LoadRun",
    "RedisServer",
    "RequestOutcome",
    "ScenarioOptions",
    "client_lag_ms",
    "dedupe_times",
    "ejection_times",
    "main",
    "markdown_table",
    "parse_gateway_metrics",
    "print_table",
    "run_all",
    "run_load",
    "run_scenario",
    "send_request",
]

SCENARIOS = ("kill", "error", "hang", "drop", "redis")
REPLICA_FAULTS = {
    "error": {"mode": "error", "status": 500},
    "hang": {"mode": "hang"},
    "drop": {"mode": "drop", "after_chunks": 3},  # role chunk + 2 content chunks, then the cut
}
TARGET_EJECTION_S = 2.0
MODEL = "sim-llama"
# Real time (time_scale 1): ~6 ms per decode step, so 8-40 tokens take ~50-300 ms.
SIM_ARGS = ["--time-scale", "1", "--max-num-seqs", "64", "--kv-blocks", "4096", "--model", MODEL]
_ERROR_TEXT = 300


# --------------------------------------------------------------------------- requests


@dataclass(frozen=True, slots=True)
class LoadRequest:
    """One request to send (body ready to post)."""

    kind: str  # "chat" | "completion"
    body: dict[str, Any]
    headers: dict[str, str]
    stream: bool
    session_id: str | None = None
    priority: str | None = None

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.kind == "chat" else "/v1/completions"


class LoadMix:
    """Seeded stream of mixed requests: shared system prompts, optional sessions and priorities.

    Sessions are a fixed pool whose conversations restart after ``max_turns``, so a long
    soak neither grows prompts without end nor mints session ids without end (either
    would grow memory by design and hide a leak).
    """

    def __init__(
        self,
        *,
        model: str = MODEL,
        seed: int = 0,
        stream_share: float = 0.5,
        completion_share: float = 0.0,
        session_share: float = 0.0,
        priority_share: float = 0.0,
        prefix_groups: int = 8,
        prefix_len: int = 120,
        question_len: int = 24,
        max_tokens: tuple[int, int] = (8, 40),
        sessions: int = 32,
        max_turns: int = 6,
    ) -> None:
        if completion_share + session_share > 1:
            raise ValueError("completion_share + session_share must be <= 1")
        self.model = model
        self.seed = seed
        self.stream_share = stream_share
        self.completion_share = completion_share
        self.session_share = session_share
        self.priority_share = priority_share
        self.question_len = question_len
        self.max_tokens = max_tokens
        self.sessions = sessions
        self.max_turns = max_turns
        self._rng = random.Random(f"{seed}/mix")
        self._systems = [
            pseudo_text(random.Random(f"{seed}/system/{g}"), prefix_len) for g in range(prefix_groups)
        ]
        self._history: dict[str, list[dict[str, str]]] = {}

    def next(self) -> LoadRequest:
        r = self._rng
        stream = r.random() < self.stream_share
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": r.randint(*self.max_tokens),
            "stream": stream,
            "ignore_eos": True,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        headers: dict[str, str] = {}
        priority = None
        if r.random() < self.priority_share:
            priority = r.choices(PRIORITY_CLASSES, weights=(1, 3, 1))[0]
            headers["x-priority"] = priority
        system = r.choice(self._systems)
        question = pseudo_text(r, self.question_len)
        roll = r.random()
        if roll < self.session_share:
            sid = f"s{self.seed}-{r.randrange(self.sessions)}"
            headers["x-session-id"] = sid
            past = self._history.get(sid) or [{"role": "system", "content": system}]
            body["messages"] = [*past, {"role": "user", "content": question}]
            return LoadRequest("chat", body, headers, stream, sid, priority)
        if roll < self.session_share + self.completion_share:
            body["prompt"] = f"{system}\n\n{question}"
            return LoadRequest("completion", body, headers, stream, None, priority)
        body["messages"] = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return LoadRequest("chat", body, headers, stream, None, priority)

    def answered(self, request: LoadRequest, text: str) -> None:
        """Feed a session's answer back, so its next turn extends the conversation."""
        if request.session_id is None:
            return
        history = [*request.body["messages"], {"role": "assistant", "content": text}]
        if sum(1 for m in history if m["role"] == "user") >= self.max_turns:
            self._history.pop(request.session_id, None)
        else:
            self._history[request.session_id] = history


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


def _content(kind: str, payload: dict[str, Any], delta: bool) -> str:
    choices = payload.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if kind == "completion":
        return choice.get("text") or ""
    return (choice.get("delta" if delta else "message") or {}).get("content") or ""


async def _read_stream(
    resp: aiohttp.ClientResponse, req: LoadRequest, rec: RequestOutcome, sent: float
) -> str:
    parts: list[str] = []
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        rec.events += 1
        if data == b"[DONE]":
            rec.outcome = "ok" if rec.outcome == "pending" else rec.outcome
            break
        chunk = json.loads(data)
        if "error" in chunk and not chunk.get("choices"):
            rec.outcome, rec.error = "stream_error", json.dumps(chunk["error"])[:_ERROR_TEXT]
            continue  # the gateway follows its error event with [DONE]
        text = _content(req.kind, chunk, delta=True)
        if text:
            if not rec.streamed:
                rec.ttft = time.perf_counter() - sent
            rec.streamed = True
            parts.append(text)
    if rec.outcome == "pending":
        rec.outcome, rec.error = "truncated", "stream ended without [DONE]"
    return "".join(parts)


async def send_request(
    session: aiohttp.ClientSession,
    base_url: str,
    req: LoadRequest,
    rec: RequestOutcome,
    t0: float,
    timeout_s: float,
) -> str:
    """Send ``req``, fill ``rec``; return the answer text ("" unless it succeeded)."""
    sent = time.perf_counter()
    rec.start = sent - t0
    text = ""
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(base_url + req.path, json=req.body, headers=req.headers) as resp:
                rec.status = resp.status
                rec.endpoint = resp.headers.get(ENDPOINT_HEADER)
                if resp.status != 200:
                    rec.outcome = f"http_{resp.status}"
                    rec.error = (await resp.text())[:_ERROR_TEXT]
                elif req.stream:
                    text = await _read_stream(resp, req, rec, sent)
                else:
                    text = _content(req.kind, await resp.json(content_type=None), delta=False)
                    rec.ttft = time.perf_counter() - sent
                    rec.outcome = "ok"
    except TimeoutError:
        rec.outcome, rec.error = "timeout", f"no complete answer within {timeout_s:g}s"
    except aiohttp.ClientPayloadError as exc:
        rec.outcome, rec.error = "truncated", f"{type(exc).__name__}: {exc}"[:_ERROR_TEXT]
    except aiohttp.ClientError as exc:
        rec.outcome, rec.error = "connection", f"{type(exc).__name__}: {exc}"[:_ERROR_TEXT]
    except ValueError as exc:
        rec.outcome, rec.error = "bad_payload", f"{type(exc).__name__}: {exc}"[:_ERROR_TEXT]
    finally:
        rec.latency = time.perf_counter() - sent
    return text if rec.ok else ""


@dataclass
class LoadRun:
    records: list[RequestOutcome]
    t0: float  # perf_counter() at the load's start: every record time is relative to it
    load_s: float  # how long new requests were started


async def run_load(
    base_url: str,
    mix: LoadMix,
    *,
    rate: float,
    duration_s: float,
    max_requests: int | None = None,
    request_timeout_s: float = 10.0,
    seed: int = 0,
    t0: float | None = None,
    records: list[RequestOutcome] | None = None,
) -> LoadRun:
    """Open-loop Poisson arrivals for ``duration_s`` (and at most ``max_requests``), then drain.

    Bounded: every request has its own timeout, so draining ends ``request_timeout_s``
    after the last arrival at the latest. No connection limit in the client, so it never
    queues in front of the gateway (no coordinated omission). Records are appended to
    ``records`` (if given) as requests start, so a concurrent task can watch them.
    """
    if rate <= 0 or duration_s <= 0:
        raise ValueError("rate and duration_s must be > 0")
    cap = max_requests if max_requests is not None else math.ceil(rate * duration_s * 2)
    arrivals = random.Random(f"{seed}/arrivals")
    records = [] if records is None else records
    tasks: set[asyncio.Task[None]] = set()
    connector = aiohttp.TCPConnector(limit=0)
    start = time.perf_counter() if t0 is None else t0

    async def one(req: LoadRequest, rec: RequestOutcome) -> None:
        text = await send_request(session, base_url, req, rec, start, request_timeout_s)
        if rec.ok:
            mix.answered(req, text)

    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None)
    ) as session:
        next_at = start
        end = start + duration_s
        while len(records) < cap:
            next_at += arrivals.expovariate(rate)
            if next_at >= end:
                break
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            req = mix.next()
            rec = RequestOutcome(len(records), 0.0, req.kind, req.stream, req.session_id, req.priority)
            rec.send_lag = max(0.0, time.perf_counter() - next_at)
            records.append(rec)
            task = asyncio.create_task(one(req, rec))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        load_s = time.perf_counter() - start
        if tasks:
            await asyncio.gather(*tasks)
    return LoadRun(records, start, load_s)


# --------------------------------------------------------------------------- gateway metrics


@dataclass
class GatewayCounters:
    """The gateway's /metrics, reduced to what fault runs need (per endpoint name)."""

    attempts: dict[str, float] = field(default_factory=dict)  # answered + failed + in flight
    requests: dict[str, float] = field(default_factory=dict)
    upstream_errors: dict[str, dict[str, float]] = field(default_factory=dict)
    retries: dict[str, float] = field(default_factory=dict)
    redis_fallbacks: dict[str, float] = field(default_factory=dict)
    session_fallbacks: dict[str, float] = field(default_factory=dict)
    healthy: dict[str, float] = field(default_factory=dict)
    ejected: dict[str, float] = field(default_factory=dict)  # breaker gauge, where the gateway has one
    retry_budget_exhausted: float = 0.0


def parse_gateway_metrics(text: str) -> GatewayCounters:
    """Per-endpoint attempt count: every attempt is in flight or ended as exactly one of an
    answered request or an upstream error (a mid-stream error is also an answered request,
    so it is left out), so the sum rises by one per attempt sent."""
    c = GatewayCounters()
    attempts: dict[str, float] = defaultdict(float)
    simple = {
        "llm_gateway_retries_total": ("reason", c.retries),
        "llm_gateway_redis_fallbacks_total": ("reason", c.redis_fallbacks),
        "llm_gateway_session_store_fallbacks_total": ("reason", c.session_fallbacks),
        "llm_gateway_endpoint_healthy": ("endpoint", c.healthy),
        "llm_gateway_endpoint_ejected": ("endpoint", c.ejected),
    }
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            ep = s.labels.get("endpoint", "")
            if s.name == "llm_gateway_requests_total":
                c.requests[ep] = c.requests.get(ep, 0.0) + s.value
                attempts[ep] += s.value
            elif s.name == "llm_gateway_upstream_errors_total":
                c.upstream_errors.setdefault(ep, {})[s.labels["kind"]] = s.value
                if s.labels["kind"] != "mid_stream":
                    attempts[ep] += s.value
            elif s.name == "llm_gateway_endpoint_in_flight_requests":
                attempts[ep] += s.value
            elif s.name == "llm_gateway_retry_budget_exhausted_total":
                c.retry_budget_exhausted += s.value
            elif s.name in simple:
                label, target = simple[s.name]
                target[s.labels[label]] = s.value
    c.attempts = dict(attempts)
    return c


class GatewayWatcher:
    """Polls the gateway's /metrics; notes, per endpoint, when its attempt count rose."""

    def __init__(self, session: aiohttp.ClientSession, url: str, t0: float, interval_s: float) -> None:
        self._session = session
        self._url = url + "/metrics"
        self._t0 = t0
        self.interval_s = interval_s
        self.events: dict[str, list[float]] = defaultdict(list)
        self.series: list[tuple[float, GatewayCounters]] = []
        self.latest: GatewayCounters | None = None
        self.first: GatewayCounters | None = None
        self.failed_polls = 0

    async def poll(self) -> GatewayCounters | None:
        try:
            async with self._session.get(self._url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError):
            self.failed_polls += 1
            return None
        now = time.perf_counter() - self._t0  # upper bound of when the counted attempts were sent
        counters = parse_gateway_metrics(text)
        before = self.latest.attempts if self.latest is not None else {}
        for ep, value in counters.attempts.items():
            if self.latest is not None and value > before.get(ep, 0.0):
                self.events[ep].append(now)
        self.series.append((now, counters))
        self.first = self.first or counters
        self.latest = counters
        return counters

    async def run(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(self.interval_s)


class ReplicaWatcher:
    """Polls one replica's /admin/state: its engine's prefix-query counter moves per admitted request.

    Blind to requests the fault answers before the engine (error, hang) and to a dead process.
    """

    def __init__(self, session: aiohttp.ClientSession, url: str, t0: float, interval_s: float) -> None:
        self._session = session
        self._url = url + "/admin/state"
        self._t0 = t0
        self.interval_s = interval_s
        self.events: list[float] = []
        self._last: float | None = None

    async def poll(self) -> None:
        try:
            async with self._session.get(self._url, timeout=aiohttp.ClientTimeout(total=1)) as resp:
                state = await resp.json()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return
        value = float(state.get("prefix_cache_queries_tokens", 0))
        if self._last is not None and value > self._last:
            self.events.append(time.perf_counter() - self._t0)
        self._last = value

    async def run(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(self.interval_s)


def dedupe_times(times: list[float], window_s: float) -> list[float]:
    """Sorted ``times`` with every time within ``window_s`` of the previously kept one dropped."""
    kept: list[float] = []
    for t in sorted(times):
        if not kept or t - kept[-1] > window_s:
            kept.append(t)
    return kept


def _sparse(times: list[float], start: float, end: float, gap_s: float, burst: int = 2) -> bool:
    """Attempts after ``start`` look like probes: ``gap_s`` apart on average, never more than
    ``burst`` within one ``gap_s`` window."""
    if times and (end - start) / len(times) < gap_s:
        return False
    return all(j + burst >= len(times) or times[j + burst] - t >= gap_s for j, t in enumerate(times))


def ejection_times(
    events: list[float], inject_at: float, load_end: float, gap_s: float
) -> tuple[float, float | None, int]:
    """(last_sent_s, ejected_after_s, attempts after ejection) from attempt times (seconds).

    Ejected at the first point after ``inject_at`` (injection itself or an attempt) that is
    followed by ``gap_s`` of silence *and* after which attempts stay probe-like (see
    :func:`_sparse`): a breaker's half-open probes do not undo an ejection, while a
    replica that merely gets little traffic is not called ejected at its first lull.
    None if no such point exists before ``load_end``.
    """
    after = sorted(t for t in events if t >= inject_at)
    if not after:
        return 0.0, 0.0, 0
    points = [inject_at, *after]
    end = max(load_end, points[-1])
    for i, t in enumerate(points):
        rest = points[i + 1 :]
        nxt = rest[0] if rest else end
        if nxt - t >= gap_s and _sparse(rest, t, end, gap_s):
            return after[-1] - inject_at, t - inject_at, len(rest)
    return after[-1] - inject_at, None, 0


# --------------------------------------------------------------------------- redis


class RedisServer:
    """A throw-away redis-server on a fixed loopback port, killable and restartable by PID."""

    def __init__(self, port: int, log_dir: Path) -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self._log_dir = log_dir
        self.process: asyncio.subprocess.Process | None = None

    async def start(self, timeout_s: float = 10.0) -> None:
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self._log_dir)]  # fmt: skip
        with (self._log_dir / f"redis-{self.port}.log").open("ab") as log_file:
            self.process = await asyncio.create_subprocess_exec(
                *argv, stdout=log_file, stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.returncode is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}")
            with contextlib.suppress(OSError):
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
                writer.write(b"PING\r\n")
                reply = await asyncio.wait_for(reader.readline(), 1)
                writer.close()
                if reply.startswith(b"+PONG"):
                    return
            await asyncio.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} not ready after {timeout_s}s")

    async def kill(self) -> None:
        if self.process is not None and self.process.returncode is None:
            os.kill(self.process.pid, signal.SIGKILL)
            await self.process.wait()

    async def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), 5)
            except TimeoutError:
                await self.kill()


# --------------------------------------------------------------------------- one scenario


@dataclass
class ScenarioOptions:
    rate: float = 50.0
    duration_s: float = 60.0
    replicas: int = 4
    request_timeout_s: float = 10.0
    poll_s: float = 0.1
    gap_s: float = 1.0
    redis_down_s: float = 3.0
    policy: str | None = None  # None: the gateway's default (redis: session-aware)
    gateway_config: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    log_dir: Path | None = None


def _gateway_yaml(scenario: str, opts: ScenarioOptions, redis_url: str | None, directory: Path) -> Path:
    config = copy.deepcopy(opts.gateway_config)
    policy = opts.policy or ("session-aware" if scenario == "redis" else None)
    if policy and not config.get("plugins"):
        config["policy"] = policy
    config.setdefault("server", {}).setdefault("drain_s", 0)  # a benchmark needs no graceful drain
    if redis_url is not None:
        config.setdefault("prefix", {}).update(backend="redis", redis_url=redis_url)
        config.setdefault("sessions", {}).update(backend="redis", redis_url=redis_url)
    path = directory / f"gateway-{scenario}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _busiest(records: list[RequestOutcome], before: float, names: list[str]) -> str:
    counts = Counter(r.endpoint for r in records if r.start < before and r.endpoint in names)
    return max(names, key=lambda n: (counts[n], -names.index(n)))


@dataclass
class _Injection:
    at: float | None = None
    endpoint: str | None = None
    redis_restarted_at: float | None = None
    replica_watcher: ReplicaWatcher | None = None
    watch_task: asyncio.Task[None] | None = None


async def _inject(
    scenario: str,
    opts: ScenarioOptions,
    replicas: list[ManagedProcess],
    redis: RedisServer | None,
    records: list[RequestOutcome],
    session: aiohttp.ClientSession,
    t0: float,
    out: _Injection,
) -> None:
    await asyncio.sleep(max(0.0, t0 + opts.duration_s / 3 - time.perf_counter()))
    if scenario == "redis":
        assert redis is not None
        out.at = time.perf_counter() - t0
        await redis.kill()
        await asyncio.sleep(opts.redis_down_s)
        await redis.start()
        out.redis_restarted_at = time.perf_counter() - t0
        return
    names = [_name(r.url) for r in replicas]
    out.endpoint = _busiest(records, time.perf_counter() - t0, names)
    victim = replicas[names.index(out.endpoint)]
    watcher = ReplicaWatcher(session, victim.url, t0, opts.poll_s)
    await watcher.poll()  # baseline just before the fault
    out.replica_watcher = watcher
    out.at = time.perf_counter() - t0
    if scenario == "kill":
        os.kill(victim.process.pid, signal.SIGKILL)
        await victim.process.wait()
        return
    async with session.post(victim.url + "/admin/fault", json=REPLICA_FAULTS[scenario]) as resp:
        resp.raise_for_status()
    out.watch_task = asyncio.create_task(watcher.run())


def _name(url: str) -> str:
    """The gateway's endpoint name for a URL (what ``x-gateway-endpoint`` carries)."""
    return url.split("://", 1)[-1].rstrip("/")


async def run_scenario(scenario: str, opts: ScenarioOptions) -> dict[str, Any]:
    """One fault run on a fresh fleet; returns the report (records included)."""
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; choose from {SCENARIOS}")
    log_dir = opts.log_dir or Path(tempfile.mkdtemp(prefix=f"llm-gateway-faults-{scenario}-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    procs: list[ManagedProcess] = []
    redis: RedisServer | None = None
    try:
        if scenario == "redis":
            redis = RedisServer(free_ports(1)[0], log_dir)
            await redis.start()
        replicas = await start_replicas(opts.replicas, SIM_ARGS, log_dir=log_dir)
        procs += replicas
        config = _gateway_yaml(scenario, opts, redis.url if redis else None, log_dir)
        gateway = await start_gateway([r.url for r in replicas], ["--config", str(config)], log_dir=log_dir)
        procs.append(gateway)
        mix = LoadMix(seed=opts.seed, session_share=0.3 if scenario == "redis" else 0.0)
        async with aiohttp.ClientSession() as session:
            t0 = time.perf_counter()
            watcher = GatewayWatcher(session, gateway.url, t0, opts.poll_s)
            await watcher.poll()
            watch_task = asyncio.create_task(watcher.run())
            records: list[RequestOutcome] = []
            load = asyncio.create_task(
                run_load(gateway.url, mix, rate=opts.rate, duration_s=opts.duration_s,
                         request_timeout_s=opts.request_timeout_s, seed=opts.seed, t0=t0, records=records)
            )  # fmt: skip
            injection = _Injection()
            inject = asyncio.create_task(
                _inject(scenario, opts, replicas, redis, records, session, t0, injection)
            )
            try:
                run = await load
                await inject
            finally:
                for task in (load, watch_task, injection.watch_task, inject):
                    if task is not None and not task.done():
                        task.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await task
            await watcher.poll()
        return _analyse(scenario, opts, run, watcher, injection, [_name(r.url) for r in replicas])
    finally:
        # Short grace: a replica still holding a hung request would otherwise wait out its shutdown.
        await asyncio.gather(*(p.stop(grace_s=2.0) for p in procs), return_exceptions=True)
        if redis is not None:
            await redis.stop()


# --------------------------------------------------------------------------- analysis


def _ms(values: list[float], q: float) -> float | None:
    p = percentile(values, q)
    return None if p is None else round(p * 1000, 1)


def client_lag_ms(records: list[RequestOutcome]) -> dict[str, float | None]:
    """p99 and max of the client's own send lag (see ``RequestOutcome.send_lag``)."""
    lags = [r.send_lag for r in records]
    return {"p99": _ms(lags, 99), "max": _ms(lags, 100)}


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    out = {k: v - before.get(k, 0.0) for k, v in sorted(after.items())}
    return {k: v for k, v in out.items() if v}


def _sent_after(watcher: GatewayWatcher, endpoint: str, at: float) -> float:
    """Attempts sent to ``endpoint`` after ``at``: the rises of its attempt count (an attempt the
    gateway abandons without counting it, e.g. re-sent because its endpoint was ejected
    meanwhile, lowers the count; a rise within the same poll interval may hide behind it)."""
    total, previous = 0.0, None
    for t, counters in watcher.series:
        value = counters.attempts.get(endpoint, 0.0)
        if previous is not None and t > at:
            total += max(0.0, value - previous)
        previous = value
    return total


def _marked_out(watcher: GatewayWatcher, endpoint: str, at: float) -> float | None:
    """First poll after ``at`` at which the gateway reported the endpoint unhealthy or ejected."""
    for t, c in watcher.series:
        if t >= at and (c.healthy.get(endpoint, 1.0) == 0 or c.ejected.get(endpoint, 0.0) == 1):
            return round(t - at, 3)
    return None


def _ejection(
    opts: ScenarioOptions, run: LoadRun, watcher: GatewayWatcher, inj: _Injection
) -> dict[str, Any]:
    assert inj.endpoint is not None and inj.at is not None
    sources = {
        "client_headers": [r.start for r in run.records if r.endpoint == inj.endpoint],
        "gateway_metrics": watcher.events.get(inj.endpoint, []),
        "replica_state": inj.replica_watcher.events if inj.replica_watcher is not None else [],
    }
    # One attempt is often seen by two or three witnesses a poll apart: count it once.
    merged = dedupe_times([t for times in sources.values() for t in times], 1.5 * opts.poll_s)
    last, ejected, probes = ejection_times(merged, inj.at, run.load_s, opts.gap_s)
    before = [c.attempts.get(inj.endpoint, 0.0) for t, c in watcher.series if t <= inj.at]
    return {
        "last_sent_s": round(last, 3),
        "ejected_after_s": None if ejected is None else round(ejected, 3),
        "attempts_after_ejection": probes,
        "attempts_before_injection_per_s": round(before[-1] / inj.at, 2) if before and inj.at > 0 else None,
        "attempts_after_injection": _sent_after(watcher, inj.endpoint, inj.at),
        "gateway_marked_out_s": _marked_out(watcher, inj.endpoint, inj.at),
        "last_seen_by_source_s": {
            name: round(max(after) - inj.at, 3) if (after := [t for t in times if t >= inj.at]) else None
            for name, times in sources.items()
        },
        "resolution_s": opts.poll_s,
        "attempt_times_s": [round(t - inj.at, 3) for t in merged if t >= inj.at],  # after injection
    }


def _analyse(
    scenario: str,
    opts: ScenarioOptions,
    run: LoadRun,
    watcher: GatewayWatcher,
    inj: _Injection,
    names: list[str],
) -> dict[str, Any]:
    records = run.records
    at = inj.at if inj.at is not None else math.inf
    failed = [r for r in records if not r.ok]
    before_first_byte = sum(1 for r in failed if not r.events)
    before_content = sum(1 for r in failed if r.events and not r.streamed)
    five_xx = sum(1 for r in records if 500 <= r.status < 600)
    first = watcher.first or GatewayCounters()
    last = watcher.latest or GatewayCounters()
    result: dict[str, Any] = {
        "scenario": scenario,
        "replicas": names,
        "rate": opts.rate,
        "duration_s": opts.duration_s,
        "load_s": round(run.load_s, 2),
        "faulted_endpoint": inj.endpoint,
        "inject_at_s": None if inj.at is None else round(inj.at, 3),
        "redis_restarted_at_s": None if inj.redis_restarted_at is None else round(inj.redis_restarted_at, 3),
        "sent": len(records),
        "ok": len(records) - len(failed),
        "failed": len(failed),
        "failed_by_reason": dict(sorted(Counter(r.outcome for r in failed).items())),
        # no byte of an answer / only a role-only chunk (the response was committed) / >= 1 content chunk
        "failed_before_first_byte": before_first_byte,
        "failed_before_content": before_content,
        "failed_mid_stream": len(failed) - before_first_byte - before_content,
        "responses_5xx": five_xx,
        "client_send_lag_ms": client_lag_ms(records),
        "latency_ms": {
            side: {"p50": _ms(values, 50), "p99": _ms(values, 99), "n": len(values)}
            for side, values in (
                ("before", [r.latency for r in records if r.ok and r.latency is not None and r.start < at]),
                ("after", [r.latency for r in records if r.ok and r.latency is not None and r.start >= at]),
            )
        },
        "gateway": {
            "retries": _delta(last.retries, first.retries),
            "upstream_errors": {
                ep: d
                for ep in sorted(last.upstream_errors)
                if (d := _delta(last.upstream_errors[ep], first.upstream_errors.get(ep, {})))
            },
            "redis_fallbacks": _delta(last.redis_fallbacks, first.redis_fallbacks),
            "session_fallbacks": _delta(last.session_fallbacks, first.session_fallbacks),
            "retry_budget_exhausted": last.retry_budget_exhausted - first.retry_budget_exhausted,
            "metrics_polls_failed": watcher.failed_polls,
        },
        "ejection": _ejection(opts, run, watcher, inj) if inj.endpoint is not None else None,
    }
    # The target: no failure of a request that had not started streaming (no content yet).
    targets: dict[str, bool] = {"no_failures_before_streaming": before_first_byte + before_content == 0}
    if scenario == "redis":
        targets["no_5xx"] = five_xx == 0
    else:
        ejected = result["ejection"]["ejected_after_s"]
        targets["ejection_within_2s"] = ejected is not None and ejected <= TARGET_EJECTION_S
    if inj.redis_restarted_at is not None:
        down = [r.latency for r in records if r.ok and r.latency and at <= r.start < inj.redis_restarted_at]
        result["latency_ms"]["redis_down"] = {"p50": _ms(down, 50), "p99": _ms(down, 99), "n": len(down)}
    result["targets"] = targets
    result["targets_met"] = all(targets.values())
    result["records"] = [asdict(r) for r in records]
    return result


# --------------------------------------------------------------------------- report


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def _pairs(values: dict[str, float]) -> str:
    return ", ".join(f"{k}:{v:g}" for k, v in values.items()) or "-"


def _total(values: dict[str, float]) -> str:
    return f"{sum(values.values()):g}" if values else "-"


def _target(r: dict[str, Any], key: str) -> str:
    if key not in r["targets"]:
        return "-"
    return "yes" if r["targets"][key] else "NO"


def _cells(r: dict[str, Any]) -> dict[str, str]:
    ej = r["ejection"] or {}
    lat = r["latency_ms"]
    gw = r["gateway"]
    return {
        "faulted": r["faulted_endpoint"] or ("redis" if r["scenario"] == "redis" else "-"),
        "injected at (s)": _fmt(r["inject_at_s"]),
        "sent / ok / failed": f"{r['sent']} / {r['ok']} / {r['failed']}",
        "failed by reason": _pairs(r["failed_by_reason"]),
        "failed before 1st byte": str(r["failed_before_first_byte"]),
        "failed after role chunk, before content": str(r["failed_before_content"]),
        "failed mid-stream": str(r["failed_mid_stream"]),
        "5xx responses": str(r["responses_5xx"]),
        "last sent to faulted (s)": _fmt(ej.get("last_sent_s")),
        "ejected after (s)": _fmt(ej.get("ejected_after_s")) if ej else "-",
        "attempts to faulted after inj.": _fmt(ej.get("attempts_after_injection")),
        "gateway marked it out after (s)": _fmt(ej.get("gateway_marked_out_s")),
        "E2E p50 before / after (ms)": f"{_fmt(lat['before']['p50'])} / {_fmt(lat['after']['p50'])}",
        "E2E p99 before / after (ms)": f"{_fmt(lat['before']['p99'])} / {_fmt(lat['after']['p99'])}",
        "gateway retries": _pairs(gw["retries"]),
        "redis / session fallbacks": f"{_total(gw['redis_fallbacks'])} / {_total(gw['session_fallbacks'])}",
        "client send lag p99 / max (ms)": "{p99} / {max}".format(**r["client_send_lag_ms"]),
        "target: 0 failures before content": _target(r, "no_failures_before_streaming"),
        "target: ejected <= 2 s": _target(r, "ejection_within_2s"),
        "target: Redis outage 0 5xx": _target(r, "no_5xx"),
    }


def _rows(results: list[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """(label, one cell per scenario), shared by the rich and markdown tables."""
    cells = [_cells(r) for r in results]
    return [(label, [c[label] for c in cells]) for label in cells[0]] if cells else []


def print_table(results: list[dict[str, Any]], console: Any = None) -> None:
    """Rich table, one column per scenario."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="llm-gateway fault runs")
    table.add_column("metric", style="bold")
    for r in results:
        table.add_column(r["scenario"], justify="right")
    for label, cells in _rows(results):
        table.add_row(label, *cells)
    if console is None:
        console = Console()
        if not console.is_terminal:  # a pipe or a log file: do not squeeze the table into 80 columns
            console = Console(width=60 + 30 * len(results))
    console.print(table)


def markdown_table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| metric | " + " | ".join(r["scenario"] for r in results) + " |",
        "|---|" + "---:|" * len(results),
    ]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in _rows(results)]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- CLI


async def run_all(scenarios: list[str], opts: ScenarioOptions) -> list[dict[str, Any]]:
    results = []
    for scenario in scenarios:
        t = time.monotonic()
        result = await run_scenario(scenario, opts)
        print(
            f"{scenario}: {time.monotonic() - t:.0f}s, targets met: {result['targets_met']}", file=sys.stderr
        )
        results.append(result)
    return results


def _parse_scenarios(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown scenario(s) {unknown}; choose from {','.join(SCENARIOS)}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rate", type=float, default=50.0, help="new requests per second (Poisson)")
    parser.add_argument(
        "--duration", type=float, default=60.0, help="seconds of load; the fault lands at 1/3"
    )
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--scenarios", type=_parse_scenarios, default=list(SCENARIOS))
    parser.add_argument("--json", type=Path, help="write the full report (records included) here")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("--request-timeout", type=float, default=10.0, help="client-side limit per request")
    parser.add_argument(
        "--poll", type=float, default=0.1, help="seconds between /metrics and /admin/state polls"
    )
    parser.add_argument("--gap", type=float, default=1.0, help="silence that counts as ejected (seconds)")
    parser.add_argument("--redis-down", type=float, default=3.0, help="seconds Redis stays down")
    parser.add_argument("--policy", help="routing preset (default: the gateway's; redis: session-aware)")
    parser.add_argument("--gateway-config", type=Path, help="base gateway YAML (e.g. resilience settings)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", type=Path, help="process logs (default: a temp dir per scenario)")
    args = parser.parse_args(argv)
    base = yaml.safe_load(args.gateway_config.read_text()) if args.gateway_config else {}
    opts = ScenarioOptions(
        rate=args.rate,
        duration_s=args.duration,
        replicas=args.replicas,
        request_timeout_s=args.request_timeout,
        poll_s=args.poll,
        gap_s=args.gap,
        redis_down_s=args.redis_down,
        policy=args.policy,
        gateway_config=base or {},
        seed=args.seed,
        log_dir=args.log_dir,
    )
    from gateway.http.server import install_uvloop

    install_uvloop()
    results = asyncio.run(run_all(args.scenarios, opts))
    print_table(results)
    met = all(r["targets_met"] for r in results)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"options": {**asdict(opts), "log_dir": str(opts.log_dir)}, "targets_met": met,
                   "scenarios": {r["scenario"]: r for r in results}}  # fmt: skip
        args.json.write_text(json.dumps(payload, indent=1))
    return 1 if args.strict and not met else 0


if __name__ == "__main__":
    sys.exit(main())
