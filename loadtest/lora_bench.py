"""Multi-LoRA workload: adapter loads and TTFT through the gateway, with and without lora-affinity.

    python -m loadtest.lora_bench [--replicas 4] [--adapters 8] [--max-loras 2] [--rate 60]
        [--duration 20] [--lora-load-ms 50] [--rounds 2] [--arms no-lora-affinity,prefix-aware]

Open-loop arrivals (Poisson, ``--rate`` per second) of streamed chat requests, each naming one
of ``--adapters`` LoRA adapters as its model (uniformly, or Zipf with ``--zipf S``). Each arm
runs on a fresh simulated fleet (``--enable-lora --max-loras N``: a batch holds at most N
adapters, a request for another waits, a non-resident adapter costs ``--lora-load-ms``), the
arms interleaved over ``--rounds`` so both see the same minutes of a shared host. Reported
per arm: adapter loads (and evictions) on the replicas per 100 requests, TTFT p50/p95.

Arms: ``prefix-aware`` (the default preset: prefix-cost 1, cache-room 0.1, lora-affinity 1),
``no-lora-affinity`` (the same without lora-affinity: the preset before it), ``lora-weight``
(the preset with lora-affinity at ``--lora-weight``), ``round-robin``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from typing import Any

import aiohttp

from gateway.config import load_config
from gateway.http.app import build_app
from gateway.http.server import start_site
from loadtest.harness.ports import free_port
from loadtest.simulator import SimConfig
from loadtest.simulator.server import start_runner

__all__ = ["main", "run_arm"]

_WORDS = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone cloud".split()


def _policy(arm: str, lora_weight: float) -> dict[str, Any]:
    if arm in ("prefix-aware", "round-robin"):
        return {"policy": arm}
    scorers = [("prefix-cost", 1.0), ("cache-room", 0.1)]
    if arm == "lora-weight":
        scorers.append(("lora-affinity", lora_weight))
    elif arm != "no-lora-affinity":
        raise SystemExit(f"unknown arm {arm!r}")
    plugins = [{"type": "healthy"}, {"type": "model"}, *({"type": t} for t, _ in scorers)]
    plugins.append({"type": "max-score", "parameters": {"tolerance": 0.02}})
    refs = [{"ref": "healthy"}, {"ref": "model"}, *({"ref": t, "weight": w} for t, w in scorers)]
    refs.append({"ref": "max-score"})
    return {"plugins": plugins, "profiles": [{"name": "default", "plugins": refs}]}


async def _one(http: aiohttp.ClientSession, url: str, model: str, rng: random.Random, out: int) -> float:
    words = " ".join(rng.choice(_WORDS) for _ in range(120))
    body = {"model": model, "messages": [{"role": "user", "content": words}], "max_tokens": out}
    started = time.perf_counter()
    async with http.post(url + "/v1/chat/completions", json={**body, "stream": True}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{resp.status} {await resp.text()}")
        first = None
        async for chunk in resp.content.iter_any():
            if first is None and b'"content":"' in chunk and b'"content":""' not in chunk:
                first = time.perf_counter()
    return (first or time.perf_counter()) - started


def _adapter(rng: random.Random, names: list[str], zipf: float) -> str:
    if zipf <= 0:
        return rng.choice(names)
    weights = [1 / (i + 1) ** zipf for i in range(len(names))]
    return rng.choices(names, weights)[0]


async def run_arm(arm: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    names = [f"adapter-{i}" for i in range(args.adapters)]
    runners, sims = [], []
    for _ in range(args.replicas):
        config = SimConfig(
            port=0,
            time_scale=args.time_scale,
            enable_lora=True,
            max_loras=args.max_loras,
            lora_modules=tuple(names),
            lora_load_ms=args.lora_load_ms,
        )
        runner, sim = await start_runner(config)
        runners.append(runner)
        sims.append(sim)
    raw = {
        **_policy(arm, args.lora_weight),
        "endpoints": [{"url": s.url} for s in sims],
        "health": {"interval_s": 0.5, "timeout_s": 2.0},
        "scrape": {"interval_s": args.scrape_s, "timeout_s": 0.5},
    }
    port = free_port("127.0.0.1")
    gateway = await start_site(build_app(load_config(overrides=raw, environ={})), "127.0.0.1", port)
    url = f"http://127.0.0.1:{port}"
    rng = random.Random(seed)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            await asyncio.sleep(1.0)  # health + first scrape
            tasks = []
            started = time.perf_counter()
            while time.perf_counter() - started < args.duration:
                model = _adapter(rng, names, args.zipf)
                tasks.append(
                    asyncio.create_task(_one(http, url, model, random.Random(rng.random()), args.output))
                )
                await asyncio.sleep(rng.expovariate(args.rate))
            ttfts = sorted(await asyncio.gather(*tasks))
    finally:
        await gateway.cleanup()
        stats = [s.state.lora.stats() for s in sims if s.state.lora is not None]
        for runner in runners:
            await runner.cleanup()
    loads = sum(s["loads"] for s in stats)
    evictions = sum(s["evictions"] for s in stats)
    return {
        "arm": arm,
        "requests": len(ttfts),
        "loads_per_100": round(100 * loads / len(ttfts), 1),
        "evictions_per_100": round(100 * evictions / len(ttfts), 1),
        "ttft_p50_ms": round(statistics.median(ttfts) * 1000, 1),
        "ttft_p95_ms": round(ttfts[int(len(ttfts) * 0.95) - 1] * 1000, 1),
    }


def _merge(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One arm's rounds: requests summed, the rest as the median of the rounds."""
    out = {"arm": rows[0]["arm"], "requests": sum(r["requests"] for r in rows), "rounds": len(rows)}
    for key in ("loads_per_100", "evictions_per_100", "ttft_p50_ms", "ttft_p95_ms"):
        out[key] = round(statistics.median(r[key] for r in rows), 1)
    return out


async def _run(args: argparse.Namespace) -> list[dict[str, Any]]:
    arms = args.arms.split(",")
    by_arm: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
    for round_index in range(args.rounds):
        order = arms if round_index % 2 == 0 else arms[::-1]
        for arm in order:  # the same seed per round: each arm sees the same arrivals
            by_arm[arm].append(await run_arm(arm, args, seed=round_index))
    return [_merge(rows) for rows in by_arm.values()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--max-loras", type=int, default=2)
    parser.add_argument("--lora-load-ms", type=float, default=50.0)
    parser.add_argument("--rate", type=float, default=60.0, help="requests per second (Poisson)")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per arm and round")
    parser.add_argument("--output", type=int, default=16, help="output tokens per request")
    parser.add_argument("--zipf", type=float, default=0.0, help="adapter popularity skew (0: uniform)")
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--scrape-s", type=float, default=0.25)
    parser.add_argument("--lora-weight", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--arms", default="no-lora-affinity,prefix-aware")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = asyncio.run(_run(args))
    if args.json:
        print(json.dumps(rows))
        return 0
    print("| arm | requests | adapter loads /100 req | evictions /100 req | TTFT p50 (ms) | TTFT p95 (ms) |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['arm']} | {r['requests']} | {r['loads_per_100']} | {r['evictions_per_100']} "
            f"| {r['ttft_p50_ms']} | {r['ttft_p95_ms']} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
