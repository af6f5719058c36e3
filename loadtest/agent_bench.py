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

``--engine vllm`` runs every policy against the same real vLLM 0.32 (CPU build) replicas
(``loadtest/realvllm``: the tiny Llama, ``--kv-blocks`` blocks of 32 tokens each, its 2,048-token
context): started once, their prefix caches reset before each policy (vLLM's dev-mode
``POST /reset_prefix_cache``), hits counted as deltas of ``vllm:prefix_cache_hits`` /
``queries``; the workload is written in the tiny model's vocabulary. ``--rounds N`` runs the
policies N times, interleaved, and reports per-policy medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from gateway.config import load_config
from gateway.http.app import build_app
from gateway.http.server import start_site
from loadtest.harness.fleet import start_gateway
from loadtest.harness.ports import free_port
from loadtest.harness.scrape import fetch_metrics, reset_prefix_caches
from loadtest.peers import start_router
from loadtest.realvllm.model import _WORDS as _VLLM_WORDS
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


def _text(rng: random.Random, words: int, vocabulary: list[str] = _WORDS) -> str:
    return " ".join(rng.choice(vocabulary) for _ in range(words))


@dataclass(frozen=True)
class Turn:
    """One turn as the client saw it; ``cached`` and ``prompt`` from the engine's usage, if reported."""

    index: int
    ttft_s: float | None
    prompt: int | None
    cached: int | None


async def _read_turn(resp: aiohttp.ClientResponse, marker: bytes, index: int, started: float) -> Turn:
    """Read the stream to its end: when the first content event arrived, and the usage of
    the final event (Responses' ``response.completed``, Messages' ``message_start``)."""
    first = None
    data = bytearray()
    async for chunk in resp.content.iter_any():
        if first is None and marker in chunk:
            first = time.perf_counter()
        data += chunk
    prompt = cached = None
    for line in bytes(data).split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[6:])
        usage = (event.get("response") or event.get("message") or {}).get("usage") or {}
        if "input_tokens_details" in usage:  # Responses
            prompt, cached = usage["input_tokens"], usage["input_tokens_details"].get("cached_tokens")
        elif "cache_read_input_tokens" in usage:  # Messages: input_tokens excludes the cache read
            cached = usage["cache_read_input_tokens"] or 0
            prompt = usage["input_tokens"] + cached
    return Turn(index, None if first is None else first - started, prompt, cached)


async def _session(http: aiohttp.ClientSession, url: str, index: int, args: argparse.Namespace) -> list[Turn]:
    rng = random.Random(index)
    words = _VLLM_WORDS if args.engine == "vllm" else _WORDS  # unknown words would all be <unk>
    system = _text(random.Random(0), args.system_words, words)  # the same for every session
    anthropic = args.apis == "messages" or (args.apis == "both" and index % 2 == 0)
    history: list[dict[str, Any]] = []
    turns = []
    for turn in range(args.turns):
        history.append({"role": "user", "content": f"turn {turn}: " + _text(rng, args.turn_words, words)})
        if anthropic:
            path, marker = "/v1/messages", b"content_block_delta"
            body: dict[str, Any] = {"model": args.model, "max_tokens": args.output_tokens, "stream": True}
            body |= {"system": system, "tools": _TOOLS, "messages": history}
            headers = {"x-claude-code-session-id": f"claude-{index}"}
            if args.engine == "vllm":  # the tiny model has no tool parser: "auto" would be a 400
                body["tool_choice"] = {"type": "none"}
        else:
            path, marker = "/v1/responses", b"response.output_text.delta"
            body = {"model": args.model, "max_output_tokens": args.output_tokens, "stream": True}
            body |= {"instructions": system, "tools": _RESPONSES_TOOLS, "input": history, "store": False}
            body["prompt_cache_key"] = f"codex-{index}"
            if args.engine == "vllm":
                body["tool_choice"] = "none"
            headers = {}
        started = time.perf_counter()
        async with http.post(url + path, json=body, headers=headers) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{path}: {resp.status} {await resp.text()}")
            turns.append(await _read_turn(resp, marker, turn, started))
        history.append({"role": "assistant", "content": _text(rng, args.output_tokens, words)})
    return turns


class _Front:
    """What the sessions talk to: the gateway in this process, or a peer router's process."""

    def __init__(self, url: str, stop: Callable[[], Awaitable[None]]) -> None:
        self.url, self.stop = url, stop


async def _front(policy: str, urls: list[str], own_process: bool) -> _Front:
    if policy.startswith("sglang-router:"):
        peer = await start_router(policy, urls)
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


async def _cache_counters(http: aiohttp.ClientSession, urls: list[str]) -> tuple[float, float, list[float]]:
    """The fleet's prefix-cache (hit tokens, queried tokens) so far and each replica's finished
    requests, from the replicas' /metrics."""
    counters = await asyncio.gather(*(fetch_metrics(http, u) for u in urls))
    return (
        sum(c["hits"] for c in counters),
        sum(c["queries"] for c in counters),
        [c["requests"] for c in counters],
    )


async def run_policy(policy: str, args: argparse.Namespace, fleet: list[str] | None = None) -> dict[str, Any]:
    """One policy on a fresh simulated fleet, or on the running real replicas ``fleet`` (caches reset)."""
    runners = []
    if fleet is None:
        urls = []
        for _ in range(args.replicas):
            config = SimConfig(port=0, time_scale=args.time_scale, kv_blocks=args.kv_blocks)
            runner, sim = await start_runner(config)
            runners.append(runner)
            urls.append(sim.url)
    else:
        urls = fleet
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
            if fleet is not None:
                await reset_prefix_caches(http, urls)
            hits_before, queries_before, served_before = await _cache_counters(http, urls)
            front = await _front(policy, urls, args.gateway_process)
            try:
                started = time.perf_counter()
                results = await asyncio.gather(
                    *(_session(http, front.url, i, args) for i in range(args.sessions))
                )
                wall = time.perf_counter() - started
            finally:
                await front.stop()
            hits, queries, served = await _cache_counters(http, urls)
    finally:
        for runner in runners:
            await runner.cleanup()
    hits, queries = hits - hits_before, queries - queries_before
    served = [after - before for after, before in zip(served, served_before, strict=True)]
    ttfts = sorted(t.ttft_s for r in results for t in r if t.ttft_s is not None)
    per_turn = []  # cached / prompt tokens by turn number, where the engine reported them
    for index in range(args.turns):
        reported = [t for r in results for t in r if t.index == index and t.cached is not None]
        prompt = sum(t.prompt or 0 for t in reported)
        per_turn.append(round(sum(t.cached or 0 for t in reported) / prompt, 3) if prompt else None)
    return {
        "policy": policy,
        "requests": len(ttfts),
        "hit_ratio": round(hits / queries, 3) if queries else 0.0,
        "queried_tokens": queries,  # the fleet's prefix-cache queries in this run (deltas)
        "ttft_p50_ms": round(statistics.median(ttfts) * 1000, 1),
        "ttft_p95_ms": round(ttfts[int(len(ttfts) * 0.95) - 1] * 1000, 1),
        "wall_s": round(wall, 1),
        "per_turn_hit": per_turn,
        "max_share": round(max(served) / sum(served), 3) if sum(served) else 0.0,
    }


def _median(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per column, the median over the rounds; the range of the hit ratio beside it."""
    out = dict(rows[0])
    for key, value in rows[0].items():
        if isinstance(value, float):
            out[key] = round(statistics.median(r[key] for r in rows), 3)
    out["hit_range"] = (min(r["hit_ratio"] for r in rows), max(r["hit_ratio"] for r in rows))
    turns = zip(*(r["per_turn_hit"] for r in rows), strict=True)
    out["per_turn_hit"] = [statistics.median(h) if all(x is not None for x in h) else None for h in turns]
    return out


def _run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every policy, ``--rounds`` times interleaved (the shared host's load drifts), on one fleet."""
    policies = args.policies.split(",")
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    replicas: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="agent-bench-") as tmp:
        if args.engine == "vllm":
            from loadtest.realvllm.fleet import MODEL_NAME, ReplicaOptions, start_replicas

            options = ReplicaOptions(num_blocks=args.kv_blocks, block_size=32)
            replicas = start_replicas(args.replicas, options, log_dir=Path(tmp) / "vllm", timeout_s=420)
            args.model = MODEL_NAME
        try:
            for _ in range(args.rounds):
                for policy in policies:
                    fleet = [r.url for r in replicas] or None
                    runs[policy].append(asyncio.run(run_policy(policy, args, fleet)))
        finally:
            if replicas:
                from loadtest.realvllm.fleet import stop_replicas

                stop_replicas(replicas)
    return [_median(rows) for rows in runs.values()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", choices=("sim", "vllm"), default="sim")
    parser.add_argument("--rounds", type=int, default=1, help="run the policies this many times, interleaved")
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
    args.model = "sim-llama"
    rows = _run_all(args)
    if args.json:
        print(json.dumps(rows))
        return 0
    if args.rounds > 1:
        print(f"medians over {args.rounds} interleaved rounds (hit ratio range in brackets)")
    print(
        "| policy | requests | prefix-cache hit ratio | TTFT p50 (ms) | TTFT p95 (ms) | wall (s) "
        "| busiest replica's share |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        low, high = r["hit_range"]
        hit = f"{r['hit_ratio']}" + (f" ({low}-{high})" if args.rounds > 1 else "")
        print(
            f"| {r['policy']} | {r['requests']} | {hit} | {r['ttft_p50_ms']} "
            f"| {r['ttft_p95_ms']} | {r['wall_s']} | {r['max_share']:.1%} |"
        )
    for r in rows:
        per_turn = " ".join("-" if h is None else f"{h:.2f}" for h in r["per_turn_hit"])
        print(f"{r['policy']}: cached / prompt tokens by turn (the engines' usage): {per_turn}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
