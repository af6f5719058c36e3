"""``python -m loadtest.overhead.ab``: several gateway source trees, interleaved in one run.

On a shared machine the CPU a gateway gets swings by 2-3x from one minute to the next, so
two ``loadtest.overhead`` runs minutes apart compare the machine, not the trees. Here every
tree's gateway runs at once against one zero-work upstream (an idle gateway costs nothing),
and the wrk runs rotate through the trees in short slices: slice 1 of tree A, of tree B, …,
then slice 2 of each, and so on. Each tree's numbers are the sums over its slices, so all
trees saw the same minutes of the machine. Reported per tree, policy and variant: req/s
(requests / wrk seconds), gateway CPU ms per 1,000 requests, and the share of a core the
gateway got while loaded, with each tree's ratio to the first.

    python -m loadtest.overhead.ab --tree old=/tmp/hotpath-base --tree new=. \\
        --policies round-robin,default --slices 4 --slice-s 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from loadtest.harness.ports import free_port
from loadtest.harness.processes import ManagedProcess, spawn, wait_ready
from loadtest.harness.procfs import cpu_seconds, process_tree
from loadtest.harness.wrk import run_wrk
from loadtest.overhead.bench import DEFAULT_VARIANTS, VARIANTS, WRK_DIR, check_target, slug
from loadtest.overhead.cli import REPO_ROOT, _start_upstream

__all__ = ["main"]


@dataclass
class _Sum:
    requests: int = 0
    seconds: float = 0.0
    cpu_s: float = 0.0
    errors: int = 0

    def row(self) -> dict[str, float]:
        return {
            "req_per_s": self.requests / self.seconds if self.seconds else 0.0,
            "cpu_ms_per_1k": 1e6 * self.cpu_s / self.requests if self.requests else 0.0,
            "cpu_share": self.cpu_s / self.seconds if self.seconds else 0.0,
            "requests": self.requests,
            "errors": self.errors,
        }


async def _start_gateway(
    tree: str, policy: str, upstream: str, log_dir: Path, name: str, workers: int = 1
) -> ManagedProcess:
    src = str(Path(tree).resolve())
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": src}
    port = free_port()
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--endpoint", upstream, "--port", str(port)]
    argv += ["--workers", str(workers)] + (["--policy", policy] if policy != "default" else [])
    gateway = await spawn(slug(name), f"http://127.0.0.1:{port}", argv, log_dir, env=env, cwd=src,
                          kill_group=True)  # fmt: skip
    await wait_ready(gateway, "/ready", streak=4 * workers, fresh_connections=True)
    return gateway


async def _start_floor(kind: str, upstream: str, log_dir: Path) -> ManagedProcess:
    """The bare proxy of ``loadtest.overhead.floor``: what the gateway costs above it is its own."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "loadtest.overhead.floor",
        kind,
        "--port",
        str(port),
        "--upstream",
        upstream,
    ]
    floor = await spawn(f"floor-{kind}", f"http://127.0.0.1:{port}", argv, log_dir, kill_group=True)
    await wait_ready(floor, "/ready", streak=2, fresh_connections=True)
    return floor


async def _run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    log_dir = out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    shape = {"upstream_chunks": args.chunks, "upstream_interval_ms": args.chunk_interval_ms}
    upstream = await _start_upstream(SimpleNamespace(upstream_workers=2, **shape), log_dir)
    results: dict[str, dict[str, dict[str, float]]] = {}
    try:
        for policy in args.policies:
            gateways: dict[str, ManagedProcess] = {}
            try:
                for name, tree in args.tree:
                    gateways[name] = await _start_gateway(
                        tree, policy, upstream.url, log_dir, f"{name}-{policy}", args.workers
                    )
                for kind in ("aiohttp", "httptools") if args.floor else ():
                    gateways[f"floor-{kind}"] = await _start_floor(kind, upstream.url, log_dir)
                    problems = await check_target(gateways[name].url, args.chunks)
                    if problems:
                        print(f"  ! {name} {policy}: {'; '.join(problems)}", flush=True)
                for variant in args.variants:
                    sums = {name: _Sum() for name in gateways}
                    script = WRK_DIR / VARIANTS[variant]
                    for gw in gateways.values():  # warm-up, not counted
                        await run_wrk(args.wrk, gw.url, script, threads=1, connections=args.connections,
                                      duration_s=args.warmup)  # fmt: skip
                    for _ in range(args.slices):
                        for name, gw in gateways.items():
                            pids = process_tree(gw.pid)
                            cpu0 = cpu_seconds(pids)
                            result, _ = await run_wrk(
                                args.wrk, gw.url, script, threads=1, connections=args.connections,
                                duration_s=args.slice_s,
                            )  # fmt: skip
                            total = sums[name]
                            total.cpu_s += cpu_seconds(pids) - cpu0
                            total.requests += result.requests
                            total.seconds += result.duration_s
                            total.errors += result.errors
                    first = None
                    for name, total in sums.items():
                        row = total.row()
                        results.setdefault(f"{policy} {variant}", {})[name] = row
                        first = first or row
                        print(
                            f"{policy:>12} {variant:<12} {name:<8} {row['req_per_s']:8,.0f} req/s"
                            f" ({row['req_per_s'] / first['req_per_s']:.2f}x)"
                            f"  cpu {row['cpu_ms_per_1k']:6.0f} ms/1k"
                            f" ({row['cpu_ms_per_1k'] / first['cpu_ms_per_1k']:.2f}x)"
                            f"  {100 * row['cpu_share']:3.0f}% of a core  errors {total.errors}",
                            flush=True,
                        )
            finally:
                for gw in gateways.values():
                    await gw.stop()
    finally:
        await upstream.stop()
    (out / "ab-latest.json").write_text(
        json.dumps({"command": " ".join(sys.argv), "results": results}, indent=2)
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.overhead.ab", description=__doc__.split("\n")[0])
    p.add_argument("--tree", action="append", required=True, type=lambda s: tuple(s.split("=", 1)),
                   help="NAME=PATH of a gateway source tree; the first is the reference")  # fmt: skip
    p.add_argument(
        "--policies", type=lambda s: [x for x in s.split(",") if x], default=["round-robin", "default"]
    )
    p.add_argument("--variants", type=lambda s: [x for x in s.split(",") if x], default=DEFAULT_VARIANTS)
    p.add_argument("--slices", type=int, default=4)
    p.add_argument("--slice-s", type=float, default=2.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--connections", type=int, default=64)
    p.add_argument("--workers", type=int, default=1, help="gateway --workers (every tree)")
    p.add_argument("--chunks", type=int, default=8, help="events per streamed answer (per-event cost)")
    p.add_argument("--floor", action="store_true", help="also the bare proxies of loadtest.overhead.floor")
    p.add_argument("--chunk-interval-ms", type=float, default=0.0, help="pace the events (own segments)")
    p.add_argument("--out", default="bench-results/overhead-ab")
    args = p.parse_args(argv)
    args.wrk = shutil.which("wrk")
    if not args.wrk:
        print("wrk not found", file=sys.stderr)
        return 2
    args.out = str(Path(args.out).resolve())
    os.chdir(REPO_ROOT)
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return asyncio.run(_run(args))


if __name__ == "__main__":
    sys.exit(main())
