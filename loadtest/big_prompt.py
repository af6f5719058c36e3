"""``python -m loadtest.big_prompt``: how long one huge prompt stalls the gateway's event loop.

A simulated replica and ``llm-gateway serve`` run as their own processes; this process
sends one prompt of ``--mb`` megabytes and, meanwhile, polls the gateway's ``/health``
every 5 ms. The slowest ``/health`` answer is the stall other requests would see. Run
for ``least-load`` (parse only) and ``prefix-aware`` (parse + hashing), a few times each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import aiohttp

from loadtest.harness.fleet import start_gateway, start_replicas, stop_all


async def _one(http: aiohttp.ClientSession, url: str, body: bytes) -> float:
    slowest = 0.0
    done = asyncio.Event()

    async def poll() -> None:
        nonlocal slowest
        while not done.is_set():
            started = time.perf_counter()
            async with http.get(url + "/health") as resp:
                await resp.read()
            slowest = max(slowest, time.perf_counter() - started)
            await asyncio.sleep(0.005)

    poller = asyncio.create_task(poll())
    headers = {"content-type": "application/json"}
    async with http.post(url + "/v1/chat/completions", data=body, headers=headers) as resp:
        await resp.read()
        assert resp.status == 200, resp.status
    done.set()
    await poller
    return slowest


async def run(mb: float, repeats: int) -> dict[str, list[float]]:
    content = "word " * int(mb * 1e6 / 5)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 1})
    sim_args = [
        "--model",
        "m",
        "--time-scale",
        "50",
        "--max-model-len",
        "100000000",
        "--kv-blocks",
        "10000000",
    ]
    results: dict[str, list[float]] = {}
    for _ in range(repeats):  # a fresh pair each time: the simulator keeps what it cached
        for policy in ("least-load", "prefix-aware"):
            replicas = await start_replicas(1, sim_args)
            gateway = await start_gateway([replicas[0].url], ["--policy", policy])
            try:
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
                    results.setdefault(policy, []).append(await _one(http, gateway.url, body.encode()))
            finally:
                await stop_all([gateway, *replicas])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.big_prompt", description=__doc__)
    parser.add_argument("--mb", type=float, default=15.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for policy, stalls in asyncio.run(run(args.mb, args.repeats)).items():
        shown = ", ".join(f"{s * 1000:.0f}" for s in stalls)
        print(f"{policy:<13} slowest /health during a {args.mb:g} MB prompt (ms): {shown}")


if __name__ == "__main__":
    main()
