"""Data-parallel ranks as routing targets vs the URL as one target, same workload, same run.

    .venv/bin/python -m loadtest.dp_bench [--replicas 2] [--dp 2] [--requests 400]

Every arm gets its own simulators started with ``--data-parallel-size`` (N schedulers and
KV caches behind one port, as vLLM's) and its own ``llm-gateway serve``; the arms run at the
same time on the same host with the same seeded workload (exact_bench's: multi-turn chat over
Zipf-popular documents). ``*-ranks`` arms route to (replica, rank) and send
``X-data-parallel-rank``; ``*-url`` arms state ``data_parallel_size: 1`` for every endpoint,
so the gateway picks a replica and vLLM's own balancer picks the rank. Reported: the
engines' own hit ratio (``vllm:prefix_cache_hits / queries``, all ranks), the hit ratio
from ``usage.prompt_tokens_details.cached_tokens``, TTFT p50/p99, and each arm's busiest
rank's share of the requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.exact_bench import Result, Workload, one
from loadtest.harness.fleet import start_gateway, start_replicas, stop_all
from loadtest.harness.scrape import fetch_metrics

ARMS = {
    "exact-ranks": {"prefix": {"exact": "auto"}},
    "exact-url": {"prefix": {"exact": "auto"}},
    "approximate-ranks": {"prefix": {"exact": "off"}},
    "approximate-url": {"prefix": {"exact": "off"}},
}


async def run_arm(name: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    sim_args = ["--kv-events", "--kv-blocks", str(args.kv_blocks), "--time-scale", str(args.time_scale)]
    sim_args += ["--data-parallel-size", str(args.dp)]
    replicas = await start_replicas(args.replicas, sim_args, log_dir=workdir / name)
    endpoints: list[dict[str, Any]] = [{"url": r.url} for r in replicas]
    if name.endswith("-url"):
        endpoints = [{**e, "data_parallel_size": 1} for e in endpoints]  # the URL as one target
    config_path = workdir / f"{name}.json"  # JSON is YAML
    config_path.write_text(json.dumps({**ARMS[name], "endpoints": endpoints}))
    gateway = await start_gateway(
        [], ["--config", str(config_path), "--policy", "prefix-aware"], log_dir=workdir / name
    )
    try:
        await asyncio.sleep(1.5)  # subscribers connect, first scrapes land (and find the ranks)
        work = Workload(args.docs, args.doc_tokens, args.active)
        results: list[tuple[Result, int]] = []
        turns = iter(range(args.requests))
        busy: set[int] = set()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:

            async def worker() -> None:
                for turn in turns:
                    cid, messages = work.next(turn, busy)  # one request per conversation at a time
                    busy.add(cid)
                    conversation = work.conversations[cid]
                    prompt = sum(len(m["content"].split()) for m in messages)
                    try:
                        result, text = await one(session, gateway.url, messages)
                    finally:
                        busy.discard(cid)
                    conversation.append({"role": "assistant", "content": text})
                    results.append((result, prompt))

            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            hits = queries = 0.0
            ranks: list[int] = []
            for replica in replicas:
                counters = await fetch_metrics(session, replica.url)
                hits += counters["hits"]
                queries += counters["queries"]
                async with session.get(replica.url + "/admin/state") as resp:
                    ranks += [r["picked"] for r in (await resp.json())["data_parallel"]]
    finally:
        await stop_all([gateway, *replicas])
    ttfts = sorted(r.ttft for r, _ in results)
    return {
        "arm": name,
        "requests": len(results),
        "hit_ratio": hits / queries if queries else 0.0,
        "cached_tokens_per_request": statistics.fmean(r.cached for r, _ in results),
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "busiest_rank_share": max(ranks) / sum(ranks) if sum(ranks) else 0.0,
        "exact_predictions": sum(1 for r, _ in results if r.predicted == r.cached) / len(results),
    }


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="dp-bench-") as tmp:
        arms = args.arms.split(",")
        return list(await asyncio.gather(*(run_arm(a, args, Path(tmp)) for a in arms)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2, help="--data-parallel-size of every replica")
    parser.add_argument("--kv-blocks", type=int, default=256, help="per rank, 16 tokens each")
    parser.add_argument("--time-scale", type=float, default=2.0)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--docs", type=int, default=16)
    parser.add_argument("--doc-tokens", type=int, default=400)
    parser.add_argument("--active", type=int, default=24, help="conversations open at once")
    parser.add_argument("--arms", default=",".join(ARMS))
    args = parser.parse_args()
    print(f"{args.replicas} replicas x {args.dp} ranks, {args.kv_blocks * 16} KV tokens per rank")
    rows = asyncio.run(main_async(args))
    columns = list(rows[0])
    print(" | ".join(columns))
    for row in rows:
        print(" | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()))


if __name__ == "__main__":
    main()
