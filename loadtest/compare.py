"""Routing-quality benchmark: the same workloads on the same simulated fleet, per router.

    python -m loadtest.compare --workload shared-prefix --workload multi-turn --workload sharegpt-like \\
        --target direct-rr --target gateway:round-robin --target gateway:prefix-aware \\
        --target sglang-router:cache_aware --target vllm-router:cache_aware

Every (workload, target) run gets a fresh, cold fleet, so no run inherits another's
caches. Targets: ``direct-rr`` (the client spreads requests round-robin over the
replicas: no proxy), ``gateway:<policy>`` (``llm-gateway serve --policy``;
``gateway:<policy>@<N>`` with ``--workers N``; a ``+kv-events`` suffix starts that run's
simulators publishing vLLM's KV events, so the gateway routes on exact state instead of
its approximate index), and
``<peer>:<policy>`` for the PyPI peer routers (``loadtest/peers.py``; skipped with a
note when not installed). The fleet is sized as issue 4 asks: each replica's KV cache
is smaller than the workload's distinct prefixes, the fleet's total is larger.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from loadtest.harness.fleet import ManagedProcess, start_gateway, start_replicas, stop_all
from loadtest.harness.ports import free_port
from loadtest.ideal import ideal_hit_ratio
from loadtest.report import markdown_table, plot, print_comparison, summarize, write_json
from loadtest.runner import BenchResult, DirectRoundRobinTarget, GatewayTarget, Target, run_benchmark
from loadtest.workloads import make_workload

__all__ = ["WORKLOADS", "main", "run_compare"]

BLOCK_SIZE = 16
# workload → (parameters, arrival rate req/s (None: closed loop), concurrency, KV blocks per replica)
WORKLOADS: dict[str, tuple[dict[str, Any], float | None, int | None, int]] = {
    # SGLang's generated-shared-prefix shape, scaled to 2 cores: 16 groups × 2k-token
    # system prompts = 32k distinct prefix tokens; a replica caches 16k, the fleet 64k.
    "shared-prefix": (
        dict(num_groups=16, prompts_per_group=16, system_prompt_len=2048, question_len=128, output_len=128),
        16.0,
        None,
        1024,
    ),
    # Every conversation starts with the same system prompt, then grows by its answers:
    # 32 users × ~3.3k tokens at the last turn ≈ 105k tokens; a replica caches 32k, the fleet 128k.
    "multi-turn": (
        dict(num_users=32, num_rounds=8, system_prompt_len=1000, history_len=1000, question_len=64,
             answer_len=96),
        None,
        32,
        2048,
    ),
    # No shared prefixes at all: prefix routing must not hurt.
    "sharegpt-like": (dict(num_requests=256, mean_input_len=220, mean_output_len=200), 24.0, None, 1024),
}  # fmt: skip
SIM_ARGS = [
    "--kv-blocks",
    "1024",
    "--block-size",
    str(BLOCK_SIZE),
    "--max-num-seqs",
    "48",
    "--time-scale",
    "1",
]


async def _start_target(spec: str, urls: list[str], log_dir: Path) -> tuple[Target, ManagedProcess | Any]:
    kind, _, policy = spec.partition(":")
    if kind == "direct-rr":
        return DirectRoundRobinTarget(urls, label=spec), None
    if kind == "gateway":  # gateway:<policy>[@<workers>]
        policy, _, workers = policy.partition("@")
        args = ["--policy", policy] if policy else []
        if workers:
            args += ["--workers", workers]
        proc = await start_gateway(urls, args, log_dir=log_dir)
        return GatewayTarget(proc.url, label=spec), proc
    from loadtest.peers import start_peer

    port = free_port()
    peer = await start_peer(kind, port, urls, policy or "cache_aware", log_dir=str(log_dir))
    return GatewayTarget(f"http://127.0.0.1:{port}", label=spec), peer


KV_EVENTS_SUFFIX = "+kv-events"


async def _one(workload_name: str, spec: str, log_dir: Path, progress: bool) -> BenchResult:
    params, rate, concurrency, kv_blocks = WORKLOADS[workload_name]
    sim_args = [*SIM_ARGS, "--kv-blocks", str(kv_blocks)]
    target_spec = spec.removesuffix(KV_EVENTS_SUFFIX)
    if target_spec != spec:
        sim_args.append("--kv-events")
    replicas = await start_replicas(4, sim_args, log_dir=log_dir)
    started: list[Any] = []
    try:
        urls = [r.url for r in replicas]
        target, proc = await _start_target(target_spec, urls, log_dir)
        target.label = spec
        if proc is not None:
            started.append(proc)
        workload = make_workload(workload_name, model="sim-llama", seed=11, **params)
        return await run_benchmark(
            workload,
            target,
            rate=rate,
            concurrency=concurrency,
            max_requests=workload.total_requests,
            deadline_s=240,
            replica_urls=urls,
            progress=progress,
            name=f"{workload_name} · {spec}",
        )
    finally:
        for proc in started:
            await proc.stop()
        await stop_all(replicas)


def _peer_missing(spec: str) -> str | None:
    kind = spec.partition(":")[0]
    if kind in ("direct-rr", "gateway"):
        return None
    from loadtest.peers import peer_available

    return None if peer_available(kind) else f"{kind} is not installed (see loadtest/peers.py)"


async def run_compare(
    workloads: list[str], targets: list[str], out: Path, progress: bool
) -> list[BenchResult]:
    out.mkdir(parents=True, exist_ok=True)
    results: list[BenchResult] = []
    notes: dict[str, Any] = {}
    for workload_name in workloads:
        params = WORKLOADS[workload_name][0]
        static = make_workload(workload_name, model="sim-llama", seed=11, **params)
        if workload_name != "multi-turn":  # multi-turn prompts depend on the answers
            notes[f"{workload_name} ideal hit ratio"] = round(ideal_hit_ratio(static.items(), BLOCK_SIZE), 4)
        per_workload = []
        for spec in targets:
            missing = _peer_missing(spec)
            if missing:
                notes[spec] = f"skipped: {missing}"
                continue
            t0 = time.monotonic()
            result = await _one(workload_name, spec, out / "logs", progress)
            print(f"{result.name}: {time.monotonic() - t0:.0f}s", file=sys.stderr)
            per_workload.append(result)
        if per_workload:
            print_comparison(per_workload)
            plot(per_workload, out, prefix=f"{workload_name}-")
        results.extend(per_workload)
    write_json(results, out / "compare.json")
    summary = {r.name: summarize(r).__dict__ for r in results}
    (out / "summary.json").write_text(json.dumps({"notes": notes, "runs": summary}, indent=1, default=str))
    (out / "compare.md").write_text(
        markdown_table(results) + "\n\n" + "\n".join(f"- {k}: {v}" for k, v in notes.items()) + "\n"
    )
    for key, value in notes.items():
        print(f"{key}: {value}")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", action="append", choices=sorted(WORKLOADS))
    parser.add_argument("--target", action="append")
    parser.add_argument("--out", default="bench-results/compare")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    targets = args.target or [
        "direct-rr",
        "gateway:round-robin",
        "gateway:prefix-aware",
        "sglang-router:cache_aware",
        "vllm-router:cache_aware",
    ]
    from gateway.http.server import install_uvloop

    install_uvloop()
    asyncio.run(run_compare(args.workload or list(WORKLOADS), targets, Path(args.out), not args.no_progress))
    return 0


if __name__ == "__main__":
    sys.exit(main())
