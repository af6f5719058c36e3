"""What a replay on (re)connect costs the gateway's event loop, and whether it comes back whole.

    python -m loadtest.kv_replay_stall [--batches 2000,10000] [--blocks 32] [--runs 3]

A publisher on its own thread replays as vLLM 0.32 does (``loadtest.harness.kv_replayer``:
a ROUTER with the default 1,000-message send queue, which drops what does not fit). Its
buffer holds ``--batches`` batches of ``--blocks`` stored blocks each; every batch after the
first also removes the previous one's blocks, so the engine ends holding ``--blocks`` blocks
and any removal a replay loses shows as extra blocks in the index. The gateway's own
``KVEventSubscriber`` and exact index run in this process, with a ticker task beside them
that wakes every millisecond: its longest gap while the replay is fetched and applied is the
stall every request on that event loop would see. Per run: time from subscribing to live,
the worst gap, the replay fetches and how many stopped at a hole, resets, and the blocks
indexed against the engine's. ``--replay-timeout-s`` is the gateway's setting (default 1 s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry

from gateway.config.kv_events import ExactPrefixConfig, KVEventSourceConfig
from gateway.fleet.endpoint import Endpoint
from gateway.fleet.kv_events import KVEventSubscriber
from gateway.fleet.registry import EndpointRegistry
from gateway.ops.kv_metrics import KVEventMetrics
from gateway.prefix.exact import ExactIndex
from loadtest.harness.kv_replayer import ThreadedPublisher

__all__ = ["counter_total", "main", "one_run"]

BLOCK = 16


def _buffer(batches: int, blocks: int) -> list[tuple[int, bytes]]:
    out = []
    for m in range(batches):
        hashes = [m * blocks + i + 1 for i in range(blocks)]
        events: list[dict[str, Any]] = [
            {
                "type": "BlockStored",
                "block_hashes": hashes,
                "parent_block_hash": None,
                "token_ids": [(m + i) % 30_000 for i in range(BLOCK * blocks)],
                "block_size": BLOCK,
                "medium": "GPU",
            }
        ]
        if m:
            events.append(
                {"type": "BlockRemoved", "block_hashes": [h - blocks for h in hashes], "medium": "GPU"}
            )
        out.append((m, msgspec.msgpack.encode([time.time(), events, None])))
    return out


def counter_total(counter: Any, **labels: str) -> float:
    """A prometheus_client Counter's total over the label sets that include ``labels``."""
    return sum(
        s.value
        for m in counter.collect()
        for s in m.samples
        if s.name.endswith("_total") and all(s.labels.get(k) == v for k, v in labels.items())
    )


async def one_run(batches: int, blocks: int, replay_timeout_s: float = 1.0) -> dict[str, Any]:
    pub = ThreadedPublisher()
    pub.buffer, pub.seq = _buffer(batches, blocks), batches
    endpoint = Endpoint("http://127.0.0.1:9", healthy=True)  # never asked: its stream is named
    endpoint.kv_events = KVEventSourceConfig(endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint)
    metrics = KVEventMetrics(CollectorRegistry())
    index = ExactIndex(metrics)
    config = ExactPrefixConfig(discover=False, replay_timeout_s=replay_timeout_s)
    subscriber = KVEventSubscriber(EndpointRegistry([endpoint]), None, index, metrics, config)  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    worst = 0.0

    async def ticker() -> None:
        nonlocal worst
        last = loop.time()
        while True:
            await asyncio.sleep(0.001)
            now = loop.time()
            worst = max(worst, now - last)
            last = now

    started = time.monotonic()
    ticking = asyncio.create_task(ticker())
    following = asyncio.create_task(subscriber.run())
    try:
        async with asyncio.timeout(180):
            while not index.live(endpoint.name):  # noqa: ASYNC110
                await asyncio.sleep(0.005)
        to_live = time.monotonic() - started
    finally:
        for task in (following, ticking):
            task.cancel()
        await asyncio.gather(following, ticking, return_exceptions=True)
        pub.close()
    return {
        "batches": batches,
        "blocks_per_batch": blocks,
        "to_live_s": round(to_live, 3),
        "worst_loop_gap_ms": round(worst * 1000, 1),
        "fetches": pub.replays,
        "holes": counter_total(metrics.replays, outcome="hole"),
        "resets": counter_total(metrics.resets),
        "indexed_blocks": index.size(endpoint.name),
        "engine_blocks": blocks,
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| batches × blocks | to live s | worst loop gap ms | fetches (holes) | resets"
        " | blocks indexed / engine |",
        "|---|---:|---:|---|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['batches']:,} × {r['blocks_per_batch']} | {r['to_live_s']} | {r['worst_loop_gap_ms']} "
            f"| {r['fetches']} ({r['holes']:.0f}) | {r['resets']:.0f} "
            f"| {r['indexed_blocks']:,} / {r['engine_blocks']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[2000, 10000])
    p.add_argument("--blocks", type=int, default=32)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--replay-timeout-s", type=float, default=1.0, help="prefix.kv_events.replay_timeout_s")
    p.add_argument("--out", default="bench-results/kv-replay-stall")
    args = p.parse_args(argv)
    runs = range(args.runs)
    rows = [asyncio.run(one_run(n, args.blocks, args.replay_timeout_s)) for n in args.batches for _ in runs]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "latest.json").write_text(json.dumps(rows, indent=2))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
