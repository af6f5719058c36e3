"""Overload benchmark: a mixed-priority burst at a multiple of fleet capacity.

    python -m loadtest.burst [--overload 3] [--duration 30] [--max-num-seqs 2]

Same fleet (4 simulated replicas with small batch slots, so capacity is low enough
for one machine to overload), same workload (20 % critical / 50 % standard / 30 %
sheddable), three runs, each on a fresh fleet:

1. ``gateway @ 0.5×``: the reference TTFT of critical requests at half capacity;
2. ``gateway @ N×``: the burst through the gateway (admission control on, defaults);
3. ``direct @ N×``: the same burst sent straight to the replicas (round-robin).

Fleet capacity is measured first (closed loop, all classes, no admission), so
"N×" means N times what this fleet actually sustains here. For every run it counts
sent = succeeded + 429 + other; "other" (5xx, resets, timeouts) must be 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from loadtest.harness.fleet import start_gateway, start_replicas, stop_all
from loadtest.report import percentile
from loadtest.runner import BenchResult, DirectRoundRobinTarget, GatewayTarget, run_benchmark
from loadtest.workloads import make_workload

__all__ = ["main"]

CLASSES = ("critical", "standard", "sheddable")


def _sim_args(max_num_seqs: int) -> list[str]:
    # Engines run vLLM's priority scheduling; the gateway maps classes onto it.
    return ["--max-num-seqs", str(max_num_seqs), "--kv-blocks", "2048", "--scheduling-policy", "priority"]


def _per_class(result: BenchResult) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for cls in CLASSES:
        records = [r for r in result.records if r.priority == cls]
        ok = [r for r in records if r.status == 200 and r.error is None]
        shed = [r for r in records if r.status == 429]
        ttfts = [r.ttft for r in ok if r.ttft is not None]
        rows[cls] = {
            "sent": len(records),
            "ok": len(ok),
            "429": len(shed),
            "other": len(records) - len(ok) - len(shed),
            "ttft_p50_ms": round((percentile(ttfts, 50) or 0) * 1000, 1),
            "ttft_p99_ms": round((percentile(ttfts, 99) or 0) * 1000, 1),
        }
    return rows


def _gateway_config() -> Path:
    """Admission defaults, plus class → engine priority (critical first inside the engine too)."""
    path = Path(tempfile.gettempdir()) / "llm-gateway-burst.yaml"
    path.write_text("admission:\n  engine_priority: {critical: -10, standard: 0, sheddable: 10}\n")
    return path


async def _measure_capacity(args: argparse.Namespace) -> float:
    """Requests/s the fleet completes when kept full (closed loop, 3 requests per batch slot)."""
    replicas = await start_replicas(4, _sim_args(args.max_num_seqs))
    try:
        workload = make_workload(
            "burst", model="sim-llama", seed=1, num_requests=200, prompt_len=args.prompt_len,
            output_len=args.output_len,
        )  # fmt: skip
        result = await run_benchmark(
            workload,
            DirectRoundRobinTarget([r.url for r in replicas]),
            concurrency=4 * args.max_num_seqs * 3,
            max_requests=200,
            deadline_s=120,
            progress=False,
            name="capacity",
        )
        ok = sum(1 for r in result.records if r.status == 200)
        return ok / result.duration_s
    finally:
        await stop_all(replicas)


async def _run(label: str, rate: float, via_gateway: bool, args: argparse.Namespace) -> BenchResult:
    replicas = await start_replicas(4, _sim_args(args.max_num_seqs))
    procs = list(replicas)
    try:
        urls = [r.url for r in replicas]
        if via_gateway:
            gateway = await start_gateway(urls, ["--policy", args.policy, "--config", str(_gateway_config())])
            procs.append(gateway)
            target: Any = GatewayTarget(gateway.url, label=label)
        else:
            target = DirectRoundRobinTarget(urls, label=label)
        count = max(1, int(rate * args.duration))
        workload = make_workload(
            "burst", model="sim-llama", seed=5, num_requests=count, prompt_len=args.prompt_len,
            output_len=args.output_len,
        )  # fmt: skip
        return await run_benchmark(
            workload,
            target,
            rate=rate,
            max_requests=count,
            deadline_s=args.duration + 90,
            replica_urls=urls,
            progress=False,
            name=label,
        )
    finally:
        await stop_all(procs)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    capacity = await _measure_capacity(args)
    print(f"fleet capacity: {capacity:.1f} req/s", file=sys.stderr)
    runs = [
        ("gateway @ 0.5x", 0.5 * capacity, True),
        (f"gateway @ {args.overload:g}x", args.overload * capacity, True),
        (f"direct @ {args.overload:g}x", args.overload * capacity, False),
    ]
    out: dict[str, Any] = {"capacity_rps": round(capacity, 2), "runs": {}}
    for label, rate, via_gateway in runs:
        result = await _run(label, rate, via_gateway, args)
        out["runs"][label] = {
            "rate": round(rate, 1),
            "duration_s": round(result.duration_s, 1),
            **_per_class(result),
        }
        print(label, json.dumps(out["runs"][label]), file=sys.stderr, flush=True)
    return out


def _markdown(out: dict[str, Any]) -> str:
    lines = [
        f"fleet capacity (measured): {out['capacity_rps']} req/s",
        "",
        "| run | class | sent | ok | 429 | other | TTFT p50 ms | TTFT p99 ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, run in out["runs"].items():
        for cls in CLASSES:
            c = run[cls]
            lines.append(
                f"| {label} | {cls} | {c['sent']} | {c['ok']} | {c['429']} | {c['other']} | "
                f"{c['ttft_p50_ms']} | {c['ttft_p99_ms']} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--overload", type=float, default=3.0)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--max-num-seqs", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--policy", default="prefix-aware")
    parser.add_argument("--out", default="bench-results/burst")
    args = parser.parse_args(argv)
    from gateway.http.server import install_uvloop

    install_uvloop()
    out = asyncio.run(run(args))
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "burst.json").write_text(json.dumps(out, indent=1))
    table = _markdown(out)
    (path / "burst.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
