"""How many simulated replicas can one machine run faithfully?

    python -m loadtest.fidelity [--replicas 1,2,4,8,12] [--rate-per-replica 4] [--duration 15]

For each fleet size N, start N simulator processes, drive the control workload
(``sharegpt-like``, no shared prefixes) at ``rate-per-replica × N`` req/s round-robin
from this process, and read each replica's own bookkeeping from ``/admin/state``:
the wall time its engine steps actually took over the modelled step time. 1.00 means
the simulator kept time; above ~1.05 the host is too slow and TTFT/ITL would be
inflated by the machine, not by routing. TTFT p50 is shown next to it: at a faithful
size it stays flat as N grows (each replica sees the same per-replica load).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import aiohttp

from loadtest.harness.fleet import start_replicas, stop_all
from loadtest.report import summarize
from loadtest.runner import DirectRoundRobinTarget, run_benchmark
from loadtest.workloads import make_workload

__all__ = ["main"]


async def _state(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url + "/admin/state") as resp:
        return await resp.json()


async def _one(replicas: int, rate_per_replica: float, duration_s: float) -> dict:
    procs = await start_replicas(replicas, ["--max-num-seqs", "64"])
    try:
        urls = [p.url for p in procs]
        rate = rate_per_replica * replicas
        workload = make_workload(
            "sharegpt-like",
            model="sim-llama",
            seed=3,
            num_requests=int(rate * duration_s),
            mean_output_len=100,
        )
        result = await run_benchmark(
            workload,
            DirectRoundRobinTarget(urls),
            rate=rate,
            max_requests=workload.total_requests,
            deadline_s=duration_s + 60,
            progress=False,
            name=f"{replicas} replicas",
        )
        async with aiohttp.ClientSession() as session:
            states = [await _state(session, url) for url in urls]
        ratios = [s["step_wall_over_model_total"] for s in states]
        summary = summarize(result)
        return {
            "replicas": replicas,
            "rate": rate,
            "ok": summary.ok,
            "errors": summary.errors,
            "step_wall_over_model_mean": round(sum(ratios) / len(ratios), 3),
            "step_wall_over_model_max": round(max(ratios), 3),
            "ttft_p50_ms": round((summary.ttft_p50 or 0) * 1000, 1),
            "itl_p50_ms": round((summary.itl_p50 or 0) * 1000, 2),
        }
    finally:
        await stop_all(procs)


async def run(args: argparse.Namespace) -> list[dict]:
    rows = []
    for replicas in [int(n) for n in args.replicas.split(",")]:
        row = await _one(replicas, args.rate_per_replica, args.duration)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", default="1,2,4,8,12")
    parser.add_argument("--rate-per-replica", type=float, default=4.0)
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--out", default="bench-results/fidelity.json")
    args = parser.parse_args(argv)
    from gateway.http.server import install_uvloop

    install_uvloop()
    rows = asyncio.run(run(args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print("| replicas | req/s | wall/model step (mean, max) | TTFT p50 ms | ITL p50 ms | errors |")
    print("|---:|---:|---|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['replicas']} | {r['rate']:g} | {r['step_wall_over_model_mean']:.3f}, "
            f"{r['step_wall_over_model_max']:.3f} | {r['ttft_p50_ms']} | {r['itl_p50_ms']} | {r['errors']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
