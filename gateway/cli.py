"""``llm-gateway serve | sim | bench | demo | plan``: one entry point."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path
from typing import Any

from gateway.config import ConfigError, load_config

__all__ = ["main"]


def _add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config file")
    parser.add_argument(
        "--endpoint", action="append", default=[], metavar="URL", help="model server URL (repeatable)"
    )
    parser.add_argument("--prefill", action="append", default=[], metavar="URL", help="prefill replica (P/D)")
    parser.add_argument("--decode", action="append", default=[], metavar="URL", help="decode replica (P/D)")
    parser.add_argument("--pd-protocol", choices=["vllm", "sglang"], help="P/D wire protocol (default vllm)")
    parser.add_argument(
        "--bootstrap-port",
        type=int,
        default=8998,
        help="SGLang: the prefill replicas' bootstrap port (default 8998, SGLang's); per endpoint: --config",
    )
    parser.add_argument("--host", help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="listen port (default 8080)")
    parser.add_argument("--policy", help="routing preset: round-robin, random, least-load, ...")
    parser.add_argument("--workers", type=int, help="processes sharing the port (SO_REUSEPORT)")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"])


def _serve_overrides(args: argparse.Namespace) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    server = {k: v for k, v in (("host", args.host), ("port", args.port), ("workers", args.workers)) if v}
    if server:
        overrides["server"] = server
    endpoints = [{"url": url} for url in args.endpoint]
    prefill: dict[str, Any] = {"role": "prefill"}
    if args.pd_protocol == "sglang":
        prefill["bootstrap_port"] = args.bootstrap_port
    endpoints += [{"url": url, **prefill} for url in args.prefill]
    endpoints += [{"url": url, "role": "decode"} for url in args.decode]
    if endpoints:
        overrides["endpoints"] = endpoints
    if args.pd_protocol:
        overrides["pd"] = {"protocol": args.pd_protocol}
    if args.policy:
        overrides["policy"] = args.policy
    if args.log_level:
        overrides["log_level"] = args.log_level
    return overrides


def _run_serve(args: argparse.Namespace) -> int:
    from gateway.http.app import build_app
    from gateway.http.server import ReloadSource, serve

    overrides = _serve_overrides(args)
    try:
        config = load_config(args.config, overrides=overrides)
        if not config.endpoints and not (config.discovery.kubernetes or config.discovery.dns):
            raise ConfigError(
                "endpoints: at least one endpoint (--endpoint URL or config file) or a discovery source"
                " is required"
            )
        build_app(config)  # validate plugins and profiles before forking workers
    except ConfigError as exc:
        print(f"llm-gateway: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return serve(config, ReloadSource(Path(args.config), overrides) if args.config else None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llm-gateway", description="LLM-aware routing gateway")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_serve_arguments(commands.add_parser("serve", help="run the gateway"))

    from loadtest.simulator.cli import add_sim_arguments

    add_sim_arguments(commands.add_parser("sim", help="run simulated vLLM/SGLang replicas"))
    from loadtest.bench_cli import add_bench_arguments

    add_bench_arguments(commands.add_parser("bench", help="run a benchmark workload"))
    from loadtest.demo import add_demo_arguments

    add_demo_arguments(commands.add_parser("demo", help="simulated fleet + gateway + load: the comparison"))
    from gateway.plan.cli import add_plan_arguments

    add_plan_arguments(commands.add_parser("plan", help="size a fleet: GPUs per replica, replicas"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return _run_serve(args)
    if args.command == "plan":
        from gateway.plan.cli import run_plan

        return run_plan(args)
    if args.command == "sim":
        from loadtest.simulator.cli import run_sim

        return run_sim(args)
    from gateway.http.server import install_uvloop

    install_uvloop()
    if args.command == "bench":
        from loadtest.bench_cli import run_bench

        return asyncio.run(run_bench(args))
    from loadtest.demo import run_demo

    return asyncio.run(run_demo(args))


if __name__ == "__main__":
    sys.exit(main())
