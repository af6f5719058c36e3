"""The step burst from an idle fleet (issue 16): 150 requests at once, nothing configured.

    python -m loadtest.burst_idle [--rounds 3] [--intervals 1,5]

Two simulated replicas with 2 batch slots (``--max-num-seqs 2``), fresh processes for every
run (so the fleet has never queued and the gateway knows no capacity), and 150 streamed
chat requests sent in the same instant: 30 ``critical``, 60 ``standard``, 60 ``sheddable``
(shuffled), short prompts, 32 output tokens. Arms, interleaved per round:

- ``gateway``: ``llm-gateway serve`` with its defaults (the burst-triggered scrape on);
- ``gateway-blind``: the same with ``admission.burst_scrape_requests: 0`` — the admission of
  the previous release, blind to a burst until the next scrape (the baseline);
- ``sglang-router``: ``cache_aware`` in front of the same kind of fleet, when installed
  (``loadtest/peers.py``): no admission control.

Each at the default 1 s scrape interval and at 5 s. Per class: answers by status, TTFT
p50/p99 of the served, and the deepest engine queue seen (the replicas' own
``vllm:num_requests_waiting``, polled every 50 ms). What the issue asks: every critical
request served, sheddable refused (429 + Retry-After) from the start, no 5xx, none lost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.harness.fleet import start_gateway, start_replicas, stop_all
from loadtest.harness.sse import Exchange, send
from loadtest.report import percentile

__all__ = ["main"]

MODEL = "sim-llama"
CLASSES = {"critical": 30, "standard": 60, "sheddable": 60}


def _gateway_config(arm: str, interval_s: float) -> Path:
    path = Path(tempfile.gettempdir()) / f"llm-gateway-burst-idle-{arm}-{interval_s:g}.yaml"
    text = f"scrape:\n  interval_s: {interval_s}\n  stale_after_s: {max(3.0, 3 * interval_s)}\n"
    if arm == "gateway-blind":
        text += "admission:\n  burst_scrape_requests: 0\n"
    path.write_text(text)
    return path


async def _deepest_queue(session: aiohttp.ClientSession, urls: list[str], stop: asyncio.Event) -> float:
    """The largest sum over replicas of ``num_requests_waiting`` seen while the burst runs."""
    deepest = 0.0
    while not stop.is_set():
        total = 0.0
        for url in urls:
            try:
                async with session.get(url + "/metrics") as resp:
                    text = await resp.text()
            except aiohttp.ClientError:
                continue
            for line in text.splitlines():
                if line.startswith("vllm:num_requests_waiting"):
                    total += float(line.rsplit(" ", 1)[1])
        deepest = max(deepest, total)
        try:
            await asyncio.wait_for(stop.wait(), 0.05)
        except TimeoutError:
            pass
    return deepest


async def _one_run(arm: str, interval_s: float, seed: int) -> dict[str, Any]:
    replicas = await start_replicas(2, ["--max-num-seqs", "2"])
    procs: list[Any] = list(replicas)
    urls = [r.url for r in replicas]
    try:
        if arm == "sglang-router":
            from loadtest.harness.ports import free_port
            from loadtest.peers import start_peer

            front: Any = await start_peer("sglang-router", free_port(), urls, "cache_aware")
        else:
            front = await start_gateway(urls, ["--config", str(_gateway_config(arm, interval_s))])
        procs.append(front)
        classes = [c for c, n in CLASSES.items() for _ in range(n)]
        random.Random(seed).shuffle(classes)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            stop = asyncio.Event()
            watcher = asyncio.create_task(_deepest_queue(session, urls, stop))
            started = time.perf_counter()

            async def one(i: int, priority: str) -> tuple[str, Exchange]:
                body = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"{priority} {i}: a short answer please"}],
                    "max_tokens": 32,
                    "stream": True,
                }
                ex = await send(session, front.url + "/v1/chat/completions", body, {"x-priority": priority},
                                sent=started, timeout_s=120)  # fmt: skip
                return priority, ex

            results = await asyncio.gather(*(one(i, p) for i, p in enumerate(classes)))
            wall_s = time.perf_counter() - started
            stop.set()
            deepest = await watcher
        by_class: dict[str, Any] = {}
        for priority in CLASSES:
            exchanges = [ex for p, ex in results if p == priority]
            statuses = Counter(ex.status if ex.status else ex.outcome for ex in exchanges)
            ttfts = [ex.ttft * 1000 for ex in exchanges if ex.ok and ex.ttft is not None]
            by_class[priority] = {
                "sent": len(exchanges),
                "ok": sum(1 for ex in exchanges if ex.ok),
                "status": {str(k): v for k, v in sorted(statuses.items(), key=str)},
                "ttft_p50_ms": round(percentile(ttfts, 50) or 0),
                "ttft_p99_ms": round(percentile(ttfts, 99) or 0),
            }
        return {"arm": arm, "interval_s": interval_s, "wall_s": round(wall_s, 2),
                "deepest_engine_queue": deepest, "classes": by_class}  # fmt: skip
    finally:
        await stop_all(procs)


def _pool(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds of the per-class counts and TTFTs; statuses summed."""
    out: dict[str, Any] = {"rounds": len(runs)}

    def median(values: list[float]) -> float:
        values = sorted(values)
        return values[len(values) // 2]

    out["deepest_engine_queue"] = median([r["deepest_engine_queue"] for r in runs])
    out["wall_s"] = median([r["wall_s"] for r in runs])
    out["classes"] = {}
    for priority in CLASSES:
        cells = [r["classes"][priority] for r in runs]
        statuses: Counter[str] = Counter()
        for cell in cells:
            statuses.update(cell["status"])
        out["classes"][priority] = {
            "ok_min": min(c["ok"] for c in cells),
            "ok_max": max(c["ok"] for c in cells),
            "status_total": dict(statuses),
            "ttft_p50_ms": median([c["ttft_p50_ms"] for c in cells]),
            "ttft_p99_ms": median([c["ttft_p99_ms"] for c in cells]),
        }
    return out


def markdown(pooled: dict[str, dict[str, Any]]) -> str:
    columns = (
        "scrape interval | arm | critical served | standard served | sheddable admitted"
        " | statuses (all rounds)"
        " | critical TTFT p50 / p99 ms | standard p50 / p99 | sheddable p50 / p99 | deepest engine queue"
        " | burst done s"
    )
    lines = [
        f"| {columns} |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for key, row in pooled.items():
        interval, arm = key.split("|")
        c = row["classes"]

        def served(p: str, c: dict[str, Any] = c) -> str:
            lo, hi = c[p]["ok_min"], c[p]["ok_max"]
            return f"{lo}/{CLASSES[p]}" if lo == hi else f"{lo}–{hi}/{CLASSES[p]}"

        statuses: Counter[str] = Counter()
        for p in CLASSES:
            statuses.update(c[p]["status_total"])
        status_text = ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items()))
        lines.append(
            f"| {interval} s | {arm} | {served('critical')} | {served('standard')} | {served('sheddable')} | "
            f"{status_text} | {c['critical']['ttft_p50_ms']:,.0f} / {c['critical']['ttft_p99_ms']:,.0f} | "
            f"{c['standard']['ttft_p50_ms']:,.0f} / {c['standard']['ttft_p99_ms']:,.0f} | "
            f"{c['sheddable']['ttft_p50_ms']:,.0f} / {c['sheddable']['ttft_p99_ms']:,.0f} | "
            f"{row['deepest_engine_queue']:.0f} | {row['wall_s']:.1f} |"
        )
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from loadtest.peers import peer_available

    arms = args.arms.split(",")
    if "sglang-router" in arms and not peer_available("sglang-router"):
        print("sglang-router not installed: arm skipped", file=sys.stderr)
        arms.remove("sglang-router")
    runs: dict[str, list[dict[str, Any]]] = {}
    for interval_s in (float(x) for x in args.intervals.split(",")):
        for round_ in range(args.rounds):
            for arm in arms:  # interleaved: the shared host's load drifts
                if arm == "sglang-router" and interval_s != 1.0:
                    continue  # it scrapes nothing: one interval is enough
                result = await _one_run(arm, interval_s, seed=round_)
                print(json.dumps(result), file=sys.stderr, flush=True)
                runs.setdefault(f"{interval_s:g}|{arm}", []).append(result)
    return {"runs": runs, "pooled": {k: _pool(v) for k, v in runs.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--intervals", default="1,5", help="scrape intervals (s), comma-separated")
    parser.add_argument("--arms", default="gateway,gateway-blind,sglang-router")
    parser.add_argument("--out", default="bench-results/burst-idle")
    args = parser.parse_args(argv)
    out = asyncio.run(run(args))
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "burst_idle.json").write_text(json.dumps(out, indent=1))
    table = markdown(out["pooled"])
    (path / "burst_idle.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
