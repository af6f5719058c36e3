"""How many KV events per second one gateway applies before it lags (issue 14).

    python -m loadtest.kv_apply_rate [--rates 2000,5000,10000,20000,40000,80000] [--seconds 4]

A publisher in this process speaks vLLM 0.32's wire (the simulator's ``KVEventPublisher``:
ZMQ PUB ``[topic, seq, msgpack EventBatch]`` + replay ROUTER) on a loopback port; one
``llm-gateway serve`` process subscribes to it through the per-endpoint ``kv_events``
override of a simulated replica (which serves HTTP only). Each engine "step" is one batch
of 8 events — 4 ``BlockStored`` (a chain of 4 new 16-token blocks each) and 4
``BlockRemoved`` (the blocks stored 64 steps earlier, so the index stays bounded, as an
engine under eviction pressure does). For each rate (events/s) it publishes for
``--seconds`` and reads the gateway's ``/metrics``: events applied per second, the lag
of the last applied batch (publish → apply), replays/resets (the subscriber fell behind
its socket's buffer), and the gateway's CPU seconds per 1,000 events (``/proc``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.harness.fleet import start_gateway, start_replicas, stop_all
from loadtest.harness.scrape import sum_samples
from loadtest.simulator.kv_events import KVEventPublisher
from loadtest.simulator.kvcache import KVCache

__all__ = ["main"]

BLOCK = 16
EVENTS_PER_STEP = 8
_CLK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK  # utime + stime


def _metric(text: str, name: str) -> float:
    return sum_samples(text, (name,))


class StepSource:
    """Steps of 4 stored chains + 4 removals of what was stored 64 steps ago."""

    def __init__(self) -> None:
        self._next_hash = 1
        self._history: list[list[int]] = []

    def step(self) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        stored: list[int] = []
        for _ in range(EVENTS_PER_STEP // 2):
            hashes = list(range(self._next_hash, self._next_hash + 4))
            self._next_hash += 4
            stored += hashes
            tokens = [h % 50_000 for h in hashes for _ in range(BLOCK)]
            events.append({"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
                           "token_ids": tokens, "block_size": BLOCK, "lora_id": None, "medium": "GPU",
                           "lora_name": None, "extra_keys": [None] * 4, "group_idx": 0,
                           "kv_cache_spec_kind": "full_attention"})  # fmt: skip
        self._history.append(stored)
        old = self._history.pop(0) if len(self._history) > 64 else []
        for i in range(EVENTS_PER_STEP // 2):
            events.append({"type": "BlockRemoved", "block_hashes": old[i * 4 : (i + 1) * 4], "medium": "GPU",
                           "group_idx": 0})  # fmt: skip
        return events


async def _publish(publisher: KVEventPublisher, source: StepSource, rate: float, seconds: float) -> int:
    """Publish at ``rate`` events/s for ``seconds``, paced every 5 ms; the events sent."""
    steps_per_s = rate / EVENTS_PER_STEP
    started = time.perf_counter()
    sent_steps = 0
    while (elapsed := time.perf_counter() - started) < seconds:
        due = int(elapsed * steps_per_s)
        while sent_steps < due:
            publisher.inject(source.step())
            sent_steps += 1
        await asyncio.sleep(0.005)
    return sent_steps * EVENTS_PER_STEP


async def run(args: argparse.Namespace) -> dict[str, Any]:
    publisher = KVEventPublisher(KVCache(16, BLOCK), buffer_steps=100_000)
    await publisher.start()
    sims = await start_replicas(1, [])
    procs: list[Any] = list(sims)
    rows = []
    try:
        config = Path(tempfile.mkdtemp(prefix="kv-rate-")) / "gateway.yaml"
        endpoint = {
            "url": sims[0].url,
            "kv_events": {
                "endpoint": f"tcp://127.0.0.1:{publisher.port}",
                "replay_endpoint": f"tcp://127.0.0.1:{publisher.replay_port}",
                "topic": publisher.topic,
            },
        }
        config.write_text(json.dumps({"endpoints": [endpoint], "prefix": {"exact": "auto"}}))  # fmt: skip
        gateway = await start_gateway([], ["--config", str(config)])
        procs.append(gateway)
        source = StepSource()
        async with aiohttp.ClientSession() as http:

            async def scrape() -> str:
                async with http.get(gateway.url + "/metrics") as resp:
                    return await resp.text()

            for _ in range(100):  # connected and synced: a first batch gets applied
                publisher.inject(source.step())
                await asyncio.sleep(0.05)
                if _metric(await scrape(), "llm_gateway_kv_events_applied_total") > 0:
                    break
            for rate in [float(r) for r in args.rates.split(",")]:
                before = await scrape()
                cpu0, t0 = _cpu_s(gateway.process.pid), time.perf_counter()
                sent = await _publish(publisher, source, rate, args.seconds)
                await asyncio.sleep(0.5)  # what was sent in the last instant gets its chance
                after = await scrape()
                span, cpu = time.perf_counter() - t0, _cpu_s(gateway.process.pid) - cpu0
                applied = _metric(after, "llm_gateway_kv_events_applied_total") - _metric(
                    before, "llm_gateway_kv_events_applied_total"
                )
                resets = _metric(after, "llm_gateway_kv_events_resets_total") - _metric(
                    before, "llm_gateway_kv_events_resets_total"
                )
                replays = _metric(after, "llm_gateway_kv_events_replays_total") - _metric(
                    before, "llm_gateway_kv_events_replays_total"
                )
                row = {
                    "rate_events_s": rate,
                    "sent": sent,
                    "applied": int(applied),
                    "applied_per_s": round(applied / span),
                    "applied_share": round(applied / sent, 3) if sent else None,
                    "lag_s": round(_metric(after, "llm_gateway_kv_events_lag_seconds"), 3),
                    "replays": int(replays),
                    "resets": int(resets),
                    "cpu_ms_per_1k_events": round(1000 * cpu / max(1, applied) * 1000, 1),
                    "gateway_cpu_share": round(cpu / span, 2),
                }
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        await stop_all(procs)
        await publisher.close()
    return {"events_per_step": EVENTS_PER_STEP, "seconds": args.seconds, "rows": rows}


def markdown(out: dict[str, Any]) -> str:
    lines = [
        "| offered events/s | applied events/s | applied / sent | lag of last batch s | replays | resets "
        "| gateway CPU ms per 1k events | gateway CPU share |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in out["rows"]:
        lines.append(
            f"| {r['rate_events_s']:,.0f} | {r['applied_per_s']:,} | {r['applied_share']} | {r['lag_s']} | "
            f"{r['replays']} | {r['resets']} | {r['cpu_ms_per_1k_events']} | {r['gateway_cpu_share']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="2000,5000,10000,20000,40000,80000")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--out", default="bench-results/kv-apply-rate")
    args = parser.parse_args(argv)
    out = asyncio.run(run(args))
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "rate.json").write_text(json.dumps(out, indent=1))
    print(markdown(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
