"""Small readers shared by the real-vLLM tests: the engines' own counters, over HTTP."""

from __future__ import annotations

import aiohttp

from tests.support.harness import metric_value

__all__ = ["MODEL", "engine_metric", "engine_metrics_text"]

MODEL = "tiny-llama"


async def engine_metrics_text(http: aiohttp.ClientSession, replica_url: str) -> str:
    async with http.get(replica_url + "/metrics") as resp:
        assert resp.status == 200
        return await resp.text()


async def engine_metric(http: aiohttp.ClientSession, replica_url: str, sample: str, **labels: str) -> float:
    """One sample (summed over label sets) from a replica's ``/metrics``; fails if vLLM does not export it."""
    value = metric_value(await engine_metrics_text(http, replica_url), sample, **labels)
    assert value is not None, f"{replica_url}/metrics has no {sample}{labels or ''}"
    return value
