"""``llm-gateway bench``: run one workload against one target and report.

Results accumulate in ``--out`` as ``<name>.json``; ``--compare`` adds earlier
JSON files to the table and plots so direct-rr, gateway and peer-router runs
(made one after another against the same fleet) can be shown side by side.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.report import markdown_table, plot, print_comparison, read_json, write_json
from loadtest.runner import DirectRoundRobinTarget, GatewayTarget, Target, run_benchmark
from loadtest.workloads import WORKLOADS, make_workload

__all__ = ["add_bench_arguments", "discover_model", "parse_params", "run_bench"]


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``bench`` options on ``parser`` (the lead wires the subcommand)."""
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="shared-prefix")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", metavar="URL", help="gateway or peer-router base URL")
    where.add_argument(
        "--direct", metavar="URL", action="append", help="replica URL for client round-robin (repeat)"
    )
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, help="open-loop Poisson arrivals/s ('inf' = all at once)")
    load.add_argument("--concurrency", type=int, help="closed-loop in-flight sessions")
    parser.add_argument("--max-inflight", type=int, help="cap on in-flight sessions in open-loop mode")
    parser.add_argument("--requests", type=int, default=1000, help="max requests (default 1000)")
    parser.add_argument("--duration", type=float, default=300.0, help="overall deadline in seconds")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply workload token lengths")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", help="model name (default: first id from the target's /v1/models)")
    parser.add_argument("--api", choices=["chat", "completion"], default="chat")
    parser.add_argument(
        "--param", metavar="KEY=VALUE", action="append", default=[], help="workload parameter (repeat)"
    )
    parser.add_argument("--replica", metavar="URL", action="append", help="replica to scrape /metrics from")
    parser.add_argument("--name", help="label of this run in tables and plots")
    parser.add_argument("--out", default="bench-results", help="output directory")
    parser.add_argument("--compare", metavar="JSON", action="append", default=[], help="earlier results")
    parser.add_argument("--no-progress", action="store_true")


def parse_params(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` strings -> dict, values parsed as JSON when possible (ints, floats)."""
    params: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--param expects KEY=VALUE, got {pair!r}")
        try:
            params[key.strip().replace("-", "_")] = json.loads(raw)
        except json.JSONDecodeError:
            params[key.strip().replace("-", "_")] = raw
    return params


async def discover_model(base_url: str) -> str | None:
    """First model id served at ``base_url`` (None when it cannot be asked)."""
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
            session.get(base_url.rstrip("/").removesuffix("/v1") + "/v1/models") as resp,
        ):
            data = await resp.json(content_type=None)
        return str(data["data"][0]["id"])
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError, TypeError):
        return None


async def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args``; exit code 0 when any request succeeded."""
    target: Target = DirectRoundRobinTarget(args.direct) if args.direct else GatewayTarget(args.target)
    first_url = args.direct[0] if args.direct else args.target
    try:
        params = parse_params(args.param)
        model = args.model or await discover_model(first_url) or "default"
        workload = make_workload(
            args.workload, model=model, seed=args.seed, scale=args.scale, api=args.api, **params
        )
    except (TypeError, ValueError) as exc:
        print(f"bench: {exc}")
        return 2
    rate = args.rate
    concurrency = args.concurrency
    if rate is None and concurrency is None:
        rate = workload.default_rate
        concurrency = None if rate is not None else 16
    if rate is not None and math.isnan(rate):
        print("bench: --rate must be a number")
        return 2
    if rate is not None and args.max_inflight:
        concurrency = args.max_inflight

    name = args.name or ("direct-rr" if args.direct else args.target)
    result = await run_benchmark(
        workload,
        target,
        rate=rate,
        concurrency=concurrency,
        max_requests=args.requests,
        deadline_s=args.duration,
        replica_urls=args.replica,
        progress=not args.no_progress,
        name=name,
        seed=args.seed,
    )
    results = [r for path in args.compare for r in read_json(path)] + [result]
    out = Path(args.out)
    json_path = write_json([result], out / f"{_file_name(name)}.json")
    pngs = plot(results, out)
    (out / "comparison.md").write_text(markdown_table(results))
    print_comparison(results)
    print(f"wrote {json_path}, {out / 'comparison.md'}, " + ", ".join(str(p) for p in pngs))
    return 0 if any(r.ok for r in result.records) else 1


def _file_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:80] or "run"
