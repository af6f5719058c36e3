"""Prefix-aware vs round-robin routing in front of real vLLM replicas, scored by the engines.

The hit ratio is what the engines themselves count — Δ``vllm:prefix_cache_hits_total``
over Δ``vllm:prefix_cache_queries_total``, summed over replicas — not what the gateway
believes. Each policy runs the same workload from a cold cache (``POST
/reset_prefix_cache``, a vLLM dev-mode endpoint).

The workload is sized against the replicas' KV cache: a few conversations, each with
its own ~1000-token system prompt, revisited turn after turn. Spread over both
replicas, every conversation fits in the cache of the replica it sticks to; sprayed
round-robin, every replica must hold all of them, and the least recently used
prefixes are evicted before their conversation comes back.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from loadtest.harness import sse
from loadtest.harness.scrape import fetch_metrics
from loadtest.realvllm.fleet import ReplicaOptions, install_signal_exits, running_fleet

__all__ = [
    "EngineCounters",
    "RunResult",
    "Workload",
    "engine_counters",
    "format_table",
    "reset_prefix_caches",
    "run_cli",
    "run_workload",
]

_WORDS = (
    "cache prefix block token model server gateway replica route policy queue load memory engine batch "
    "stream chunk prompt answer question context document section table figure value number report"
).split()


@dataclass(frozen=True)
class Workload:
    conversations: int = 5  # odd: round-robin must not pin conversation i to replica i % 2 by accident
    turns: int = 4
    system_items: int = 480  # "word42" items: ≈ 2 tokens each with the tiny model's tokenizer
    max_tokens: int = 4
    seed: int = 0
    model: str = "tiny-llama"

    def system_prompt(self, conversation: int) -> str:
        """~3.9 characters per token, close to the gateway's 4-characters-per-token estimate."""
        rng = random.Random(f"{self.seed}-{conversation}")
        items = (f"{rng.choice(_WORDS)}{rng.randint(0, 99)}" for _ in range(self.system_items))
        return f"conversation {conversation}: " + " ".join(items)

    def bodies(self) -> list[dict[str, Any]]:
        """Chat bodies in send order: turn by turn, each turn visiting every conversation."""
        systems = [self.system_prompt(c) for c in range(self.conversations)]
        out = []
        for turn in range(self.turns):
            for conv, system in enumerate(systems):
                messages = [{"role": "system", "content": system}]
                for earlier in range(turn):
                    messages.append({"role": "user", "content": f"question {earlier} of {conv}"})
                    messages.append({"role": "assistant", "content": f"answer {earlier} to {conv}"})
                messages.append({"role": "user", "content": f"question {turn} of {conv}"})
                out.append({"model": self.model, "messages": messages, "max_tokens": self.max_tokens})
        return out


@dataclass(frozen=True)
class EngineCounters:
    queries: float
    hits: float


async def engine_counters(http: aiohttp.ClientSession, urls: Sequence[str]) -> dict[str, EngineCounters]:
    out = {}
    for url in urls:
        counters = await fetch_metrics(http, url)
        out[url] = EngineCounters(counters["queries"], counters["hits"])
    return out


async def reset_prefix_caches(http: aiohttp.ClientSession, urls: Sequence[str]) -> None:
    """Cold caches for the next run (vLLM refuses while blocks are in use: the fleet must be idle)."""
    for url in urls:
        async with http.post(url + "/reset_prefix_cache") as resp:
            if resp.status != 200:
                raise RuntimeError(f"{url}/reset_prefix_cache: {resp.status} {await resp.text()}")


@dataclass
class RunResult:
    policy: str
    requests: int = 0
    failures: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0  # as the responses' usage reported them
    queries: dict[str, float] = field(default_factory=dict)  # Δ per replica
    hits: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def hit_ratio(self) -> float:
        """Engine-counted: Δhits / Δqueries over all replicas."""
        queries = sum(self.queries.values())
        return sum(self.hits.values()) / queries if queries else 0.0

    @property
    def usage_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


async def run_workload(
    http: aiohttp.ClientSession,
    gateway_url: str,
    replica_urls: Sequence[str],
    workload: Workload,
    policy: str = "",
) -> RunResult:
    """Send the workload through ``gateway_url`` one request at a time; diff the engines' counters."""
    result = RunResult(policy)
    before = await engine_counters(http, replica_urls)
    started = time.monotonic()
    for body in workload.bodies():
        result.requests += 1
        answer = await sse.send(http, gateway_url + "/v1/chat/completions", body, error_chars=2000)
        if not answer.ok or answer.usage is None:
            result.failures.append(f"{answer.status}: {answer.error or 'no usage in the answer'}")
            continue
        usage = answer.usage
        result.prompt_tokens += usage["prompt_tokens"]
        result.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    result.wall_s = time.monotonic() - started
    # The API server updates its counters as outputs arrive; wait (bounded) until all are in.
    deadline = time.monotonic() + 3.0
    while True:
        after = await engine_counters(http, replica_urls)
        queried = sum(after[u].queries - before[u].queries for u in replica_urls)
        if queried >= result.prompt_tokens or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    result.queries = {u: after[u].queries - before[u].queries for u in replica_urls}
    result.hits = {u: after[u].hits - before[u].hits for u in replica_urls}
    return result


def format_table(results: Sequence[RunResult]) -> str:
    lines = [
        f"{'policy':<14} {'requests':>8} {'failed':>6} {'engine hit ratio':>16} {'usage cached':>12} "
        f"{'prompt tokens per replica':<28} {'wall s':>6}"
    ]
    for r in results:
        spread = " / ".join(f"{q:.0f}" for q in r.queries.values())
        lines.append(
            f"{r.policy:<14} {r.requests:>8} {len(r.failures):>6} {r.hit_ratio:>16.3f} "
            f"{r.usage_ratio:>12.3f} {spread:<28} {r.wall_s:>6.1f}"
        )
    return "\n".join(lines)


async def _bench(replica_urls: list[str], workload: Workload, log_dir: Any) -> list[RunResult]:
    from loadtest.harness.fleet import start_gateway, stop_all

    results = []
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, trust_env=False) as http:
        for policy in ("prefix-aware", "round-robin"):
            gateway = await start_gateway(replica_urls, ["--policy", policy], name=policy, log_dir=log_dir)
            try:
                await reset_prefix_caches(http, replica_urls)
                results.append(await run_workload(http, gateway.url, replica_urls, workload, policy))
            finally:
                await stop_all([gateway])
    return results


def run_cli(args: argparse.Namespace) -> int:
    """``python -m loadtest.realvllm.bench [--replicas N] [--num-blocks B]``."""
    options = ReplicaOptions(num_blocks=args.num_blocks or 128)
    workload = Workload()
    started = time.monotonic()
    with running_fleet(args.replicas, options) as replicas:
        print(f"{len(replicas)} replicas ready in {time.monotonic() - started:.1f}s; {options}", flush=True)
        urls = [r.url for r in replicas]
        results = asyncio.run(_bench(urls, workload, replicas[0].log_path.parent))
    print(format_table(results))
    for r in results:
        for failure in r.failures[:5]:
            print(f"  {r.policy} failure: {failure}")
    return 0 if not any(r.failures for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.realvllm.bench", description=__doc__)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--num-blocks", type=int, default=None, help="--num-gpu-blocks-override per replica")
    args = parser.parse_args(argv)
    install_signal_exits()
    return run_cli(args)


if __name__ == "__main__":
    sys.exit(main())
