"""Scheduling-latency micro-benchmark: one 8k-token prompt against 16 endpoints.

    python -m loadtest.sched_bench [--endpoints 16] [--prompt-tokens 8192] [--iterations 2000]
        [--redis redis://127.0.0.1:6379/0]

Measures, per request, the stages the gateway runs before it sends: parsing the
OpenAI body, hashing the prompt into blocks, and the scheduler (prefix match in the
index + every scorer + picker) — with the memory index and, when ``--redis`` is
given, the Redis index (one Lua round trip on loopback). Each index is warmed with
the prompt's prefix recorded on a few endpoints, so the match does real work.
Reported as p50/p99 in µs; the baseline in the same run is the ``least-load`` preset,
which reads no index.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
import uuid

from gateway.config import load_config
from gateway.fleet.endpoint import Endpoint
from gateway.http.app import build_plugin_context
from gateway.http.plugins import default_registry
from gateway.http.presets import scheduler_specs
from gateway.ops.metrics import GatewayMetrics
from gateway.prefix.memory import MemoryPrefixIndex
from gateway.request.parse import parse_request
from gateway.request.types import ApiKind
from gateway.scheduling.build import build_scheduler

__all__ = ["main"]


def _percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_us": round(ordered[len(ordered) // 2] * 1e6, 1),
        "p99_us": round(ordered[int(len(ordered) * 0.99)] * 1e6, 1),
        "mean_us": round(statistics.fmean(ordered) * 1e6, 1),
    }


def _body(tokens: int, seed: int) -> bytes:
    rng = random.Random(seed)
    words = [rng.choice("alpha beta gamma delta epsilon zeta theta kappa".split()) for _ in range(tokens)]
    system = " ".join(words[: tokens // 2])
    user = " ".join(words[tokens // 2 :])
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return json.dumps({"model": "m", "messages": messages, "stream": True}).encode()


async def _measure(policy: str, index, endpoints: list[Endpoint], body: bytes, iterations: int) -> dict:
    config = load_config(overrides={"policy": policy}, environ={})
    context = build_plugin_context(config, GatewayMetrics(), prefix_index=index)
    prefix = context.prefix
    scheduler = build_scheduler(*scheduler_specs(config), default_registry(), context)
    # Warm: the prompt's prefix is cached on 3 of the endpoints, to different depths.
    warm = parse_request(ApiKind.CHAT, body, request_id="warm", headers={})
    hashes = prefix.hashes(warm)
    for depth, endpoint in zip((len(hashes), len(hashes) // 2, len(hashes) // 4), endpoints, strict=False):
        index.record(hashes[:depth], endpoint.name, "m")
    if hasattr(index, "flush"):
        await index.flush()
    parse_s, hash_s, schedule_s = [], [], []
    for i in range(iterations):
        t0 = time.perf_counter()
        request = parse_request(ApiKind.CHAT, body, request_id=str(i), headers={})
        t1 = time.perf_counter()
        if scheduler.preparers:
            prefix.hashes(request)
        t2 = time.perf_counter()
        await scheduler.schedule(request, endpoints)
        t3 = time.perf_counter()
        parse_s.append(t1 - t0)
        hash_s.append(t2 - t1)
        schedule_s.append(t3 - t2)
    return {
        "parse": _percentiles(parse_s),
        "hash": _percentiles(hash_s),
        "schedule": _percentiles(schedule_s),
    }


async def run(args: argparse.Namespace) -> dict:
    endpoints = [
        Endpoint(url=f"http://10.0.0.{i}:8000", configured_models=frozenset({"m"}), healthy=True)
        for i in range(args.endpoints)
    ]
    for i, endpoint in enumerate(endpoints):
        endpoint.in_flight = i % 5
        endpoint.pending_prefill_tokens = 100.0 * (i % 3)
    body = _body(args.prompt_tokens, seed=1)
    results = {
        "setup": {
            "endpoints": args.endpoints,
            "prompt_tokens": args.prompt_tokens,
            "prompt_bytes": len(body),
            "iterations": args.iterations,
        },
        "least-load (baseline, no index)": await _measure(
            "least-load", MemoryPrefixIndex(), endpoints, body, args.iterations
        ),
        "prefix-aware, memory index": await _measure(
            "prefix-aware", MemoryPrefixIndex(), endpoints, body, args.iterations
        ),
    }
    if args.redis:
        import redis.asyncio as aioredis

        from gateway.prefix.redis import RedisPrefixIndex

        key_prefix = f"llmgw-bench-{uuid.uuid4().hex[:8]}"
        client = aioredis.from_url(args.redis)
        latencies: list[float] = []
        index = RedisPrefixIndex(
            client, MemoryPrefixIndex(), key_prefix=key_prefix, budget_s=0.05, on_latency=latencies.append
        )
        try:
            results["prefix-aware, redis index"] = await _measure(
                "prefix-aware", index, endpoints, body, args.iterations
            )
            results["prefix-aware, redis index"]["redis_match_round_trip"] = _percentiles(latencies)
        finally:
            keys = [key async for key in client.scan_iter(f"{key_prefix}:*")]
            if keys:
                await client.delete(*keys)
            await index.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--endpoints", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--redis", help="Redis URL to also measure the Redis-backed index")
    args = parser.parse_args(argv)
    results = asyncio.run(run(args))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
