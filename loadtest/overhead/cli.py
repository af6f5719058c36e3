"""``python -m loadtest.overhead``: the scenario — direct, each gateway configuration, each peer."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loadtest.harness.ports import free_port
from loadtest.harness.processes import ManagedProcess, spawn, wait_ready
from loadtest.overhead.bench import DEFAULT_VARIANTS, MODEL, VARIANTS, Bench, slug
from loadtest.overhead.profile import profile_gateway
from loadtest.overhead.table import HEADER, Row, added, cpu_per_1k, line, markdown_table
from loadtest.peers import PEER_ROUTERS, PeerStartError, peer_available, start_peer

__all__ = ["build_parser", "main", "run_overhead"]

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class _Outcome:
    notes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    profile: dict[str, Any] = field(default_factory=dict)


async def _start_upstream(args: argparse.Namespace, log_dir: Path) -> ManagedProcess:
    port = free_port()
    argv = [sys.executable, "-m", "loadtest.zero_upstream", "--port", str(port)]
    argv += ["--workers", str(args.upstream_workers), "--model", MODEL]
    argv += ["--chunks", str(getattr(args, "upstream_chunks", 8))]
    argv += ["--chunk-interval-ms", str(getattr(args, "upstream_interval_ms", 0.0))]
    upstream = await spawn("zero-upstream", f"http://127.0.0.1:{port}", argv, log_dir, kill_group=True)
    try:
        await wait_ready(upstream, "/health", streak=2 * args.upstream_workers, fresh_connections=True)
    except BaseException:
        await upstream.stop()
        raise
    return upstream


def _gateway_env(args: argparse.Namespace) -> tuple[dict[str, str] | None, str | None]:
    """Benchmark another checkout of the gateway (e.g. `git archive` of a commit) with the
    same interpreter: its directory goes first on the import path."""
    if not args.gateway_src:
        return None, None
    src = str(Path(args.gateway_src).resolve())
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": src}
    env["PYTHONPATH"] += os.pathsep + os.environ.get("PYTHONPATH", "")
    return env, src


async def _measure_gateway(bench: Bench, policy: str, workers: int, out: Path, result: _Outcome) -> None:
    args = bench.args
    name = f"llm-gateway {policy} w{workers}"
    port = free_port()
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--endpoint", bench.upstream.url]
    argv += ["--port", str(port), "--workers", str(workers)]
    if policy != "default":
        argv += ["--policy", policy]
    env, cwd = _gateway_env(args)
    url = f"http://127.0.0.1:{port}"
    gateway = await spawn(slug(name), url, argv, bench.log_dir, env=env, cwd=cwd, kill_group=True)
    try:
        await wait_ready(gateway, "/ready", streak=4 * workers, fresh_connections=True)
        await bench.measure(name, "gateway", gateway.url, gateway.pid, {"policy": policy, "workers": workers})
        if args.profile and not result.profile and workers == 1:
            result.profile = await profile_gateway(bench, name, gateway.url, gateway.pid, out)
            print("\n" + HEADER)
    except RuntimeError as exc:
        result.notes.append(f"{name}: {exc}")
        result.failures.append(name)
        print(f"  ! {name}: {exc}", flush=True)
        bench.failed(name, "gateway", "FAILED (see notes)")
    finally:
        await gateway.stop()


async def _measure_peer(bench: Bench, peer_name: str, result: _Outcome) -> None:
    if peer_name not in PEER_ROUTERS or not peer_available(peer_name):
        note = f"{peer_name} not installed (.venv-peers or LLMGW_PEERS_PYTHON): skipped"
        result.notes.append(note)
        bench.failed(peer_name, "peer", "not installed")
        print(f"  - {note}", flush=True)
        return
    try:
        upstreams = [bench.upstream.url]
        peer = await start_peer(peer_name, free_port(), upstreams, "round_robin", log_dir=bench.log_dir)
    except PeerStartError as exc:
        result.notes.append(f"{peer_name}: {exc}")
        result.failures.append(peer_name)
        print(f"  ! {peer_name} did not start: {str(exc)[:500]}", flush=True)
        bench.failed(peer_name, "peer", "FAILED to start")
        return
    try:
        await bench.measure(f"{peer_name} round_robin", "peer", peer.url, peer.pid, {"policy": "round_robin"})
    finally:
        await peer.stop()


async def run_overhead(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_dir = out / "logs"
    log_dir.mkdir(exist_ok=True)
    upstream = await _start_upstream(args, log_dir)
    bench = Bench(args, upstream, log_dir)
    result = _Outcome()
    try:
        print(f"zero upstream at {upstream.url} ({args.upstream_workers} worker(s)); {_machine()}")
        print(
            f"wrk -t{args.threads} -c{args.connections} -d{args.duration:g}s --latency "
            f"(+{args.warmup:g}s warm-up per variant)\n"
        )
        print(HEADER)
        config = {"upstream_workers": args.upstream_workers}
        await bench.measure("direct", "direct", upstream.url, None, config)
        for policy in args.policies:
            for workers in args.workers_list:
                await _measure_gateway(bench, policy, workers, out, result)
        for peer_name in args.peers:
            await _measure_peer(bench, peer_name, result)
    finally:
        await upstream.stop()
    return _report(args, bench, result, out)


def _print_summary(ordered: list[Row], direct_of: dict[str, Row | None], result: _Outcome) -> bool:
    print("\n" + HEADER)
    for row in ordered:
        print(line(row, direct_of.get(row.variant)))
    flagged = [r for r in ordered if r.wrk is not None and r.flagged]
    if flagged:
        print(f"\n{len(flagged)} run(s) had errors (ERR): their numbers are not comparable.")
    for note in result.notes:
        print(f"note: {note}")
    if result.failures:
        print(f"\nFAILED to start or measure: {', '.join(result.failures)}")
    return bool(flagged)


def _row_json(r: Row, direct: Row | None) -> dict[str, Any]:
    return {
        "target": r.target,
        "kind": r.kind,
        "variant": r.variant,
        "config": r.config,
        "flagged": r.flagged if r.wrk else None,
        "problems": r.problems,
        "note": r.note,
        "wrk": asdict(r.wrk) if r.wrk else None,
        "router_cpu_s": r.router_cpu_s,
        "upstream_cpu_s": r.upstream_cpu_s,
        "router_cpu_ms_per_1k": cpu_per_1k(r.router_cpu_s, r.wrk.requests) if r.wrk else None,
        **added(r, direct),
    }


def _report(args: argparse.Namespace, bench: Bench, result: _Outcome, out: Path) -> int:
    rows = bench.rows
    direct_of = {v: bench.direct(v) for v in args.variants}
    ordered = sorted(rows, key=lambda r: (args.variants.index(r.variant), rows.index(r)))
    flagged = _print_summary(ordered, direct_of, result)
    table = markdown_table(ordered, direct_of)
    report = {
        "command": " ".join(["python -m loadtest.overhead", *sys.argv[1:]]),
        "machine": _machine(),
        "wrk": {
            "threads": args.threads,
            "connections": args.connections,
            "duration_s": args.duration,
            "warmup_s": args.warmup,
        },
        "upstream_workers": args.upstream_workers,
        "gateway_src": args.gateway_src,
        "rows": [_row_json(r, direct_of.get(r.variant)) for r in ordered],
        "notes": result.notes,
        "failures": result.failures,
        "profile": result.profile,
        "markdown": table,
    }
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out / f"overhead-{stamp}.json").write_text(json.dumps(report, indent=2))
    (out / "overhead-latest.json").write_text(json.dumps(report, indent=2))
    (out / "overhead-latest.md").write_text(table + "\n")
    print(f"\nwrote {out / f'overhead-{stamp}.json'} and {out / 'overhead-latest.md'}")
    return 1 if flagged or result.failures else 0


def _machine() -> str:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return (
        f"{os.cpu_count()} CPUs ({model or platform.processor()}), Python {platform.python_version()},"
        f" {platform.system()} {platform.release()}"
    )


def _csv(kind):
    def parse(text: str) -> list:
        return [kind(x.strip()) for x in text.split(",") if x.strip()]

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.overhead", description="Gateway overhead against a zero-work upstream"
    )
    p.add_argument("--duration", type=float, default=10.0, help="seconds per wrk run (default 10)")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds of wrk before each measured run")
    p.add_argument("--connections", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="wrk threads (default 1)")
    p.add_argument("--workers-list", type=_csv(int), default=[1, 2], help="gateway --workers values")
    p.add_argument(
        "--policies",
        type=_csv(str),
        default=["round-robin", "default"],
        help="gateway policies; 'default' = no --policy flag (default: round-robin,default)",
    )
    p.add_argument("--peers", type=_csv(str), default=["sglang-router", "vllm-router"])
    p.add_argument(
        "--variants", type=_csv(str), default=DEFAULT_VARIANTS, help="chat,chat_stream[,chat_session,agent]"
    )
    p.add_argument("--upstream-workers", type=int, default=2, help="zero upstream processes (SO_REUSEPORT)")
    p.add_argument(
        "--chunks", dest="upstream_chunks", type=int, default=8, help="events per streamed answer (default 8)"
    )
    p.add_argument(
        "--chunk-interval-ms",
        dest="upstream_interval_ms",
        type=float,
        default=0.0,
        help="pace the events, as an engine decoding does (default 0: all at once)",
    )
    p.add_argument("--profile", action="store_true", help="py-spy the first gateway (w1) in an extra run")
    p.add_argument("--py-spy", default=None, help="py-spy binary (default: next to python, then PATH)")
    p.add_argument("--wrk", default=None, help="wrk binary (default: wrk on PATH)")
    p.add_argument("--gateway-src", default=None, help="run the gateway from this source tree instead")
    p.add_argument("--out", default="bench-results/overhead")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        print(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}", file=sys.stderr)
        return 2
    args.wrk = args.wrk or shutil.which("wrk")
    if not args.wrk:
        print("wrk not found (apt-get install wrk, or --wrk PATH)", file=sys.stderr)
        return 2
    if args.profile:
        candidate = Path(sys.executable).parent / "py-spy"
        args.py_spy = args.py_spy or (str(candidate) if candidate.exists() else shutil.which("py-spy"))
        if not args.py_spy:
            print("--profile needs py-spy (pip install py-spy)", file=sys.stderr)
            return 2
    args.out = str(Path(args.out).resolve())
    os.chdir(REPO_ROOT)  # `python -m gateway.cli` and `-m loadtest.zero_upstream` resolve from here
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return asyncio.run(run_overhead(args))
