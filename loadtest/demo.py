"""``llm-gateway demo``: a simulated fleet, the gateway, and load — printing the comparison.

For each workload the demo starts a *cold* fleet of 4 simulated replicas, runs the
workload once with the client spreading requests round-robin over the replicas
(``direct-rr``, the baseline: what a plain load balancer does) and once through the
gateway with its default policy, each on a fresh fleet, and prints one table.

The fleet is sized as the benchmark issue asks: each replica's KV cache is smaller
than the set of distinct prompt prefixes, the fleet's total cache is larger, so
where a request lands decides whether its prefix is a cache hit.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from loadtest.harness.fleet import start_gateway, start_replicas, stop_all
from loadtest.report import markdown_table, plot, print_comparison, write_json
from loadtest.runner import BenchResult, DirectRoundRobinTarget, GatewayTarget, Target, run_benchmark
from loadtest.workloads import make_workload

__all__ = ["DEMO_WORKLOADS", "add_demo_arguments", "run_demo"]

# (workload name, parameters, arrival rate req/s or None for closed loop, concurrency)
DEMO_WORKLOADS: dict[str, tuple[dict, float | None, int | None]] = {
    "shared-prefix": (
        dict(num_groups=8, prompts_per_group=24, system_prompt_len=1500, question_len=64, output_len=48),
        24.0,
        None,
    ),
    "multi-turn": (
        dict(
            num_users=16, num_rounds=6, system_prompt_len=600, history_len=300, question_len=80, answer_len=48
        ),
        None,
        16,
    ),
}

# Per replica: 512 blocks × 16 tokens = 8k tokens of KV — five of the eight shared
# prefixes, or four users' conversations; the fleet of four holds all of them.
SIM_ARGS = ["--kv-blocks", "512", "--block-size", "16", "--max-num-seqs", "32", "--time-scale", "1"]


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--policy", default=None, help="gateway policy preset (default: the gateway's)")
    parser.add_argument("--workload", action="append", choices=sorted(DEMO_WORKLOADS), help="repeatable")
    parser.add_argument("--out", default="bench-results/demo", help="where JSON, markdown and plots go")
    parser.add_argument("--no-progress", action="store_true")


async def _one_run(
    workload_name: str, via_gateway: bool, args: argparse.Namespace, log_dir: Path
) -> BenchResult:
    params, rate, concurrency = DEMO_WORKLOADS[workload_name]
    replicas = await start_replicas(args.replicas, SIM_ARGS, log_dir=log_dir)
    procs = list(replicas)
    try:
        urls = [r.url for r in replicas]
        target: Target
        if via_gateway:
            gateway_args = ["--policy", args.policy] if args.policy else []
            gateway = await start_gateway(urls, gateway_args, log_dir=log_dir)
            procs.append(gateway)
            target = GatewayTarget(gateway.url, label="gateway")
        else:
            target = DirectRoundRobinTarget(urls, label="direct-rr")
        workload = make_workload(workload_name, model="sim-llama", seed=7, **params)
        label = f"{workload_name} · {target.label}"
        return await run_benchmark(
            workload,
            target,
            rate=rate,
            concurrency=concurrency,
            max_requests=workload.total_requests,
            deadline_s=90,
            replica_urls=urls,
            progress=not args.no_progress,
            name=label,
        )
    finally:
        await stop_all(procs)


async def run_demo(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_dir = out / "logs"
    started = time.monotonic()
    results: list[BenchResult] = []
    for workload_name in args.workload or list(DEMO_WORKLOADS):
        for via_gateway in (False, True):
            results.append(await _one_run(workload_name, via_gateway, args, log_dir))
    print_comparison(results)
    write_json(results, out / "demo.json")
    (out / "demo.md").write_text(markdown_table(results) + "\n")
    paths = plot(results, out)
    print(f"\ndemo finished in {time.monotonic() - started:.0f}s; results in {out}/demo.json, {out}/demo.md")
    for path in paths:
        print(f"plot: {path}")
    return 0 if all(r.records for r in results) else 1
