"""``python -m loadtest.faults``: run the scenarios, print the table, write the JSON."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

import loadtest.faults
from loadtest.faults.report import print_table
from loadtest.faults.scenarios import SCENARIOS, ScenarioOptions, run_scenario

__all__ = ["main", "run_all"]


async def run_all(scenarios: list[str], opts: ScenarioOptions) -> list[dict[str, Any]]:
    results = []
    for scenario in scenarios:
        t = time.monotonic()
        result = await run_scenario(scenario, opts)
        print(
            f"{scenario}: {time.monotonic() - t:.0f}s, targets met: {result['targets_met']}", file=sys.stderr
        )
        results.append(result)
    return results


def _parse_scenarios(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown scenario(s) {unknown}; choose from {','.join(SCENARIOS)}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.faults",
        description=loadtest.faults.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rate", type=float, default=50.0, help="new requests per second (Poisson)")
    parser.add_argument(
        "--duration", type=float, default=60.0, help="seconds of load; the fault lands at 1/3"
    )
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--scenarios", type=_parse_scenarios, default=list(SCENARIOS))
    parser.add_argument("--json", type=Path, help="write the full report (records included) here")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("--request-timeout", type=float, default=10.0, help="client-side limit per request")
    parser.add_argument(
        "--poll", type=float, default=0.1, help="seconds between /metrics and /admin/state polls"
    )
    parser.add_argument("--gap", type=float, default=1.0, help="silence that counts as ejected (seconds)")
    parser.add_argument("--redis-down", type=float, default=3.0, help="seconds Redis stays down")
    parser.add_argument("--policy", help="routing preset (default: the gateway's; redis: session-aware)")
    parser.add_argument("--gateway-config", type=Path, help="base gateway YAML (e.g. resilience settings)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", type=Path, help="process logs (default: a temp dir per scenario)")
    args = parser.parse_args(argv)
    base = yaml.safe_load(args.gateway_config.read_text()) if args.gateway_config else {}
    opts = ScenarioOptions(
        rate=args.rate,
        duration_s=args.duration,
        replicas=args.replicas,
        request_timeout_s=args.request_timeout,
        poll_s=args.poll,
        gap_s=args.gap,
        redis_down_s=args.redis_down,
        policy=args.policy,
        gateway_config=base or {},
        seed=args.seed,
        log_dir=args.log_dir,
    )
    from gateway.http.server import install_uvloop

    install_uvloop()
    results = asyncio.run(run_all(args.scenarios, opts))
    print_table(results)
    met = all(r["targets_met"] for r in results)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"options": {**asdict(opts), "log_dir": str(opts.log_dir)}, "targets_met": met,
                   "scenarios": {r["scenario"]: r for r in results}}  # fmt: skip
        args.json.write_text(json.dumps(payload, indent=1))
    return 1 if args.strict and not met else 0
