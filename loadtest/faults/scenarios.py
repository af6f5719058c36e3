"""The fault scenarios: which fault, when, on what fleet, under what load."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from loadtest.faults.analysis import Injection, analyse
from loadtest.harness.fleet import ManagedProcess, start_gateway, start_replicas, stop_all
from loadtest.harness.inject import REPLICA_FAULTS, fault_replica, redis_outage, sleep_until
from loadtest.harness.processes import log_dir as make_log_dir
from loadtest.harness.redis_server import RedisServer
from loadtest.harness.steady import LoadRun, RequestOutcome, run_load
from loadtest.harness.watch import GatewayWatcher, ReplicaWatcher
from loadtest.mix import MixedWorkload

__all__ = ["MODEL", "SCENARIOS", "SIM_ARGS", "ScenarioOptions", "run_scenario"]

SCENARIOS = ("kill", "error", "hang", "drop", "redis")
assert set(SCENARIOS) == {"kill", "redis", *REPLICA_FAULTS}
MODEL = "sim-llama"
# Real time (time_scale 1): ~6 ms per decode step, so 8-40 tokens take ~50-300 ms.
SIM_ARGS = ["--time-scale", "1", "--max-num-seqs", "64", "--kv-blocks", "4096", "--model", MODEL]


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


def _busiest(records: list[RequestOutcome], before: float, names: list[str]) -> str:
    counts = Counter(r.endpoint for r in records if r.start < before and r.endpoint in names)
    return max(names, key=lambda n: (counts[n], -names.index(n)))


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


def _name(url: str) -> str:
    """The gateway's endpoint name for a URL (what ``x-gateway-endpoint`` carries)."""
    return url.split("://", 1)[-1].rstrip("/")


def _busiest(records: list[RequestOutcome], before: float, names: list[str]) -> str:
    counts = Counter(r.endpoint for r in records if r.start < before and r.endpoint in names)
    return max(names, key=lambda n: (counts[n], -names.index(n)))


@dataclass
class _Fleet:
    replicas: list[ManagedProcess]
    gateway: ManagedProcess
    redis: RedisServer | None
    session: aiohttp.ClientSession
    t0: float
    records: list[RequestOutcome] = field(default_factory=list)


async def _inject(scenario: str, opts: ScenarioOptions, fleet: _Fleet, out: Injection) -> None:
    """At a third of the run: fault the busiest replica (or Redis), and watch it from then on."""
    await sleep_until(fleet.t0, opts.duration_s / 3)
    if scenario == "redis":
        assert fleet.redis is not None
        out.at, out.redis_restarted_at = await redis_outage(fleet.redis, opts.redis_down_s, fleet.t0)
        return
    names = [_name(r.url) for r in fleet.replicas]
    out.endpoint = _busiest(fleet.records, time.perf_counter() - fleet.t0, names)
    victim = fleet.replicas[names.index(out.endpoint)]
    out.replica_watcher = ReplicaWatcher(fleet.session, victim.url, fleet.t0, opts.poll_s)
    await out.replica_watcher.poll()  # baseline just before the fault
    out.at = time.perf_counter() - fleet.t0
    await fault_replica(fleet.session, victim, scenario)
    if scenario != "kill":  # a dead replica has no state to poll
        await out.replica_watcher.run()


async def _cancel(*tasks: asyncio.Task[Any]) -> None:
    for task in tasks:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _load_with_fault(
    scenario: str, opts: ScenarioOptions, fleet: _Fleet, watcher: GatewayWatcher, out: Injection
) -> LoadRun:
    mix = MixedWorkload(model=MODEL, seed=opts.seed, session_share=0.3 if scenario == "redis" else 0.0)
    watching = asyncio.create_task(watcher.run())
    load = asyncio.create_task(
        run_load(fleet.gateway.url, mix, rate=opts.rate, duration_s=opts.duration_s, t0=fleet.t0,
                 request_timeout_s=opts.request_timeout_s, seed=opts.seed, records=fleet.records)
    )  # fmt: skip
    inject = asyncio.create_task(_inject(scenario, opts, fleet, out))
    try:
        run = await load
        if scenario in ("kill", "redis") or inject.done():
            await inject  # its error, if any; the others watch the replica until the load ends
        return run
    finally:
        await _cancel(load, watching, inject)


async def run_scenario(scenario: str, opts: ScenarioOptions) -> dict[str, Any]:
    """One fault run on a fresh fleet; returns the report (records included)."""
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; choose from {SCENARIOS}")
    log_dir = make_log_dir(opts.log_dir, prefix=f"llm-gateway-faults-{scenario}-")
    procs: list[ManagedProcess] = []
    redis: RedisServer | None = None
    try:
        if scenario == "redis":
            redis = await RedisServer(log_dir=log_dir).start_async()
        replicas = await start_replicas(opts.replicas, SIM_ARGS, log_dir=log_dir)
        procs += replicas
        config = _gateway_yaml(scenario, opts, redis.url if redis else None, log_dir)
        gateway = await start_gateway([r.url for r in replicas], ["--config", str(config)], log_dir=log_dir)
        procs.append(gateway)
        async with aiohttp.ClientSession() as session:
            fleet = _Fleet(replicas, gateway, redis, session, time.perf_counter())
            watcher = GatewayWatcher(session, gateway.url, fleet.t0, opts.poll_s)
            await watcher.poll()
            injection = Injection()
            run = await _load_with_fault(scenario, opts, fleet, watcher, injection)
            await watcher.poll()
        return analyse(scenario, opts, run, watcher, injection, [_name(r.url) for r in replicas])
    finally:
        # Short grace: a replica still holding a hung request would otherwise wait out its shutdown.
        await stop_all(procs, grace_s=2.0)
        if redis is not None:
            await redis.stop_async()
