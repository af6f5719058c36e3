"""Replica-side counters (``/metrics``): prefix-cache hits and queries, finished requests.

vLLM renamed its prefix-cache counters; the first known name of each pair wins.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "ReplicaStats",
    "fetch_metrics",
    "normalize_url",
    "replica_deltas",
    "reset_prefix_caches",
    "snapshot",
    "sum_samples",
]

_HIT_NAMES = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
_QUERY_NAMES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
_SUCCESS_NAMES = ("vllm:request_success_total",)
# the engine's own TTFT (arrival at the engine to first token): client TTFT minus it is what the
# gateway, the client and the network added
_TTFT_SUM = ("vllm:time_to_first_token_seconds_sum",)
_TTFT_COUNT = ("vllm:time_to_first_token_seconds_count",)
_ERROR_TEXT_LIMIT = 500


def normalize_url(url: str) -> str:
    """A base URL without a trailing slash or ``/v1``."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


@dataclass(slots=True)
class ReplicaStats:
    """Replica-side counter deltas over the run (from ``/metrics``)."""

    url: str
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    requests: float = 0.0
    error: str | None = None

    @property
    def hit_ratio(self) -> float | None:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries > 0 else None


def sum_samples(text: str, names: tuple[str, ...]) -> float:
    total = {n: 0.0 for n in names}
    seen = dict.fromkeys(names, False)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in total:
                total[sample.name] += sample.value
                seen[sample.name] = True
    for n in names:  # first known name wins: newer vLLM names before legacy ones
        if seen[n]:
            return total[n]
    return 0.0


async def fetch_metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Scrape one replica's prefix-cache and request counters."""
    timeout = aiohttp.ClientTimeout(total=5)
    async with session.get(f"{normalize_url(url)}/metrics", timeout=timeout) as resp:
        resp.raise_for_status()
        text = await resp.text()
    return {
        "hits": sum_samples(text, _HIT_NAMES),
        "queries": sum_samples(text, _QUERY_NAMES),
        "requests": sum_samples(text, _SUCCESS_NAMES),
        "ttft_sum": sum_samples(text, _TTFT_SUM),
        "ttft_count": sum_samples(text, _TTFT_COUNT),
    }


async def reset_prefix_caches(session: aiohttp.ClientSession, urls: list[str]) -> None:
    """Empty every replica's prefix cache (vLLM's dev-mode route; the simulator serves it too),
    so a benchmark arm on a running fleet starts cold."""
    for url in urls:
        async with session.post(f"{normalize_url(url)}/reset_prefix_cache") as resp:
            resp.raise_for_status()


async def snapshot(session: aiohttp.ClientSession, urls: list[str]) -> dict[str, dict[str, float] | str]:
    async def one(url: str) -> dict[str, float] | str:
        try:
            return await fetch_metrics(session, url)
        except Exception as exc:  # a missing /metrics must not fail the benchmark
            return f"{type(exc).__name__}: {exc}"[:_ERROR_TEXT_LIMIT]

    values = await asyncio.gather(*(one(u) for u in urls))
    return dict(zip(urls, values, strict=True))


def replica_deltas(before: dict[str, Any], after: dict[str, Any]) -> list[ReplicaStats]:
    stats: list[ReplicaStats] = []
    for url, b in before.items():
        a = after.get(url)
        if isinstance(b, str) or isinstance(a, str) or a is None:
            stats.append(ReplicaStats(url, error=b if isinstance(b, str) else str(a)))
            continue
        stats.append(
            ReplicaStats(
                url,
                prefix_queries=a["queries"] - b["queries"],
                prefix_hits=a["hits"] - b["hits"],
                requests=a["requests"] - b["requests"],
            )
        )
    return stats
