"""Agent-shaped workload: concurrent coding-agent sessions through the gateway, per policy.

    python -m loadtest.agent_bench [--replicas 4] [--sessions 16] [--turns 6]
        [--system-words 1500] [--kv-blocks 768] [--time-scale 4] [--policies round-robin,session-aware]
        [--apis both|responses|messages]

Each session is an agent loop: a long system prompt and tool list shared by every session,
then turns that each extend the last (the client resends the whole history, as Claude Code
does on ``/v1/messages`` and Codex on ``/v1/responses`` with ``store: false``). Half the
sessions speak Anthropic Messages (``x-claude-code-session-id``), half the Responses API
(``prompt_cache_key``); ``--apis responses`` or ``messages`` sends every session through one
API. Every policy runs on a fresh simulated fleet in the same process; reported: the replicas'
prefix-cache hit ratio and streamed TTFT (first content event).

``--gateway-process`` runs the gateway as its own ``llm-gateway serve`` process (its own event
loop, default health and scrape intervals) instead of in the benchmark's process. A policy
``sglang-router:<policy>`` (e.g. ``sglang-router:cache_aware``) puts the peer router
(:mod:`loadtest.peers`, its own process, hub and proxies pointed at a dead loopback port) in
front of the fleet instead of the gateway. sglang-router 0.3.2 routes ``/v1/responses`` but
answers ``/v1/messages`` with 404, so compare it with ``--apis responses``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from gateway.config import load_config
from gateway.http.app import build_app
from gateway.http.server import start_site
from loadtest.harness.fleet import start_gateway
from loadtest.harness.ports import free_port
from loadtest.peers import start_peer
from loadtest.simulator import SimConfig
from loadtest.simulator.server import start_runner

__all__ = ["main", "run_policy"]

_WORDS = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone cloud".split()
_TOOLS = [
    {"name": n, "description": f"{n} a file in the repository", "input_schema": {"type": "object"}}
    for n in ("read", "write", "edit", "grep", "bash", "glob")
]
# The same tools as the Responses API types them (a function tool has a "type").
_RESPONSES_TOOLS = [
    {"type": "function", "name": t["name"], "description": t["description"], "parameters": t["input_schema"]}
    for t in _TOOLS
]


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


async def _first_event(resp: aiohttp.ClientResponse, marker: bytes) -> float | None:
    """Read the stream to its end; the time the first content event arrived."""
    first = None
    async for chunk in resp.content.iter_any():
        if first is None and marker in chunk:
            first = time.perf_counter()
    return first


async def _session(
    http: aiohttp.ClientSession, url: str, index: int, args: argparse.Namespace
) -> list[float]:
    rng = random.Random(index)
    system = _text(random.Random(0), args.system_words)  # the same for every session
    anthropic = args.apis == "messages" or (args.apis == "both" and index % 2 == 0)
    history: list[dict[str, Any]] = []
    ttfts = []
    for turn in range(args.turns):
        history.append({"role": "user", "content": f"turn {turn}: " + _text(rng, args.turn_words)})
        if anthropic:
            path, marker = "/v1/messages", b"content_block_delta"
            body: dict[str, Any] = {"model": "sim-llama", "max_tokens": args.output_tokens, "stream": True}
            body |= {"system": system, "tools": _TOOLS, "messages": history}
            headers = {"x-claude-code-session-id": f"claude-{index}"}
        else:
            path, marker = "/v1/responses", b"response.output_text.delta"
            body = {"model": "sim-llama", "max_output_tokens": args.output_tokens, "stream": True}
            body |= {"instructions": system, "tools": _RESPONSES_TOOLS, "input": history, "store": False}
            body["prompt_cache_key"] = f"codex-{index}"
            headers = {}
        started = time.perf_counter()
        async with http.post(url + path, json=body, headers=headers) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{path}: {resp.status} {await resp.text()}")
            first = await _first_event(resp, marker)
        if first is not None:
            ttfts.append(first - started)
        history.append({"role": "assistant", "content": _text(rng, args.output_tokens)})
    return ttfts


class _Front:
    """What the sessions talk to: the gateway in this process, or a peer router's process."""

    def __init__(self, url: str, stop: Callable[[], Awaitable[None]]) -> None:
        self.url, self.stop = url, stop


async def _front(policy: str, urls: list[str], own_process: bool) -> _Front:
    if policy.startswith("sglang-router:"):
        peer = await start_peer("sglang-router", free_port("127.0.0.1"), urls, policy.split(":", 1)[1])
        return _Front(peer.url, peer.stop)
    if own_process:  # `llm-gateway serve` in its own process, as the peer runs
        proc = await start_gateway(urls, ["--policy", policy])
        return _Front(proc.url, proc.stop)
    raw = {
        "policy": policy,
        "endpoints": [{"url": u} for u in urls],
        "health": {"interval_s": 0.5, "timeout_s": 2.0},
        "scrape": {"interval_s": 0.25, "timeout_s": 0.5},
    }
    port = free_port("127.0.0.1")
    gateway = await start_site(build_app(load_config(overrides=raw, environ={})), "127.0.0.1", port)
    return _Front(f"http://127.0.0.1:{port}", gateway.cleanup)


async def run_policy(policy: str, args: argparse.Namespace) -> dict[str, Any]:
    runners, sims = [], []
    for _ in range(args.replicas):
        config = SimConfig(port=0, time_scale=args.time_scale, kv_blocks=args.kv_blocks)
        runner, sim = await start_runner(config)
        runners.append(runner)
        sims.append(sim)
    front = await _front(policy, [s.url for s in sims], args.gateway_process)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            started = time.perf_counter()
            results = await asyncio.gather(
                *(_session(http, front.url, i, args) for i in range(args.sessions))
            )
            wall = time.perf_counter() - started
    finally:
        await front.stop()
        states = [s.engine.state() for s in sims]
        for runner in runners:
            await runner.cleanup()
    ttfts = sorted(t for r in results for t in r)
    queried = sum(s["prefix_cache_queries_tokens"] for s in states)
    hits = sum(s["prefix_cache_hits_tokens"] for s in states)
    return {
        "policy": policy,
        "requests": len(ttfts),
        "hit_ratio": round(hits / queried, 3) if queried else 0.0,
        "ttft_p50_ms": round(statistics.median(ttfts) * 1000, 1),
        "ttft_p95_ms": round(ttfts[int(len(ttfts) * 0.95) - 1] * 1000, 1),
        "wall_s": round(wall, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-words", type=int, default=1500)
    parser.add_argument("--turn-words", type=int, default=120)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--kv-blocks", type=int, default=768)
    parser.add_argument("--time-scale", type=float, default=4.0)
    parser.add_argument("--policies", default="round-robin,session-aware")
    parser.add_argument("--apis", choices=("both", "responses", "messages"), default="both")
    parser.add_argument(
        "--gateway-process", action="store_true", help="run the gateway as its own process (as a peer runs)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = [asyncio.run(run_policy(p, args)) for p in args.policies.split(",")]
    if args.json:
        print(json.dumps(rows))
        return 0
    print("| policy | requests | prefix-cache hit ratio | TTFT p50 (ms) | TTFT p95 (ms) | wall (s) |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['policy']} | {r['requests']} | {r['hit_ratio']} | {r['ttft_p50_ms']} "
            f"| {r['ttft_p95_ms']} | {r['wall_s']} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
