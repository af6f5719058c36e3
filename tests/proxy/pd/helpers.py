"""Shared pieces of the P/D tests: a prefill/decode fleet of simulators behind a real gateway."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import aiohttp

from loadtest.simulator import RunningSimulator
from tests.support.harness import Gateway, gateway_metrics, metric_value

MODEL = "sim-llama"
PROTOCOLS = ("vllm", "sglang")


def long_prompt(n_words: int = 900, tag: str = "a") -> str:
    """About one token per word with the simulator's tokenizer."""
    return " ".join(f"{tag}{i % 97}" for i in range(n_words))


def endpoints(protocol: str, prefills: list[RunningSimulator], decodes: list[RunningSimulator]) -> list[dict]:
    eps: list[dict[str, Any]] = []
    for p in prefills:
        ep: dict[str, Any] = {"url": p.url, "role": "prefill", "engine": protocol}
        if protocol == "sglang":
            ep["bootstrap_port"] = p.config.port  # the simulator serves its bootstrap server on its HTTP port
        eps.append(ep)
    eps += [{"url": d.url, "role": "decode", "engine": protocol} for d in decodes]
    return eps


def pd_counts(sim: RunningSimulator) -> tuple[int, int]:
    """(honoured, recomputed) KV transfers seen by a simulator."""
    return sim.state.pd.honoured, sim.state.pd.recomputed


def finished(sim: RunningSimulator) -> int:
    """Requests the simulator completed (aborted ones not counted)."""
    return sim.engine.state()["finished"].get("length", 0) + sim.engine.state()["finished"].get("stop", 0)  # type: ignore[union-attr]


async def sim_metric(http: aiohttp.ClientSession, sim: RunningSimulator, sample: str, **labels: str) -> float:
    async with http.get(sim.url + "/metrics") as r:
        assert r.status == 200
        return metric_value(await r.text(), sample, **labels) or 0.0


async def gw_metric(http: aiohttp.ClientSession, gw: Gateway, sample: str, **labels: str) -> float:
    return metric_value(await gateway_metrics(http, gw), sample, **labels) or 0.0


async def stop_process(proc: asyncio.subprocess.Process, grace_s: float = 10.0) -> None:
    """SIGTERM a process this test started, then SIGKILL it if it outlives ``grace_s``."""
    if proc.returncode is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), grace_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
