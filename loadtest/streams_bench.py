"""Many concurrent open streams through one gateway process, against the same upstream direct.

    python -m loadtest.streams_bench [--streams 1000,5000,9000] [--interval-ms 2000] [--workers 1]

The upstream is ``loadtest.zero_upstream --chunk-interval-ms``: each stream is 8 SSE events
one interval apart, then ``[DONE]`` (timers, no per-stream task, so the upstream is not
what limits). The client (this process) opens the streams over ``--ramp-s`` seconds on
raw asyncio connections (one request each) and timestamps every read that carries events;
the same count of streams goes first straight to the upstream (the baseline), then through
one ``llm-gateway serve`` (round-robin, ``--workers``, one by default). Reported per run: streams
completed / failed, time to first event p50/p99, the gap between events p50/p99 (ideally
the interval; the table also gives the gateway's p99 gap as a ratio of direct's), and the
gateway's RSS before and at peak.

Why at most ~9,000 here: the machine's hard ``RLIMIT_NOFILE`` is 20,000 and cannot be raised
(``ulimit -Hn``); a proxied stream holds two descriptors in the gateway (client + upstream),
so one gateway process cannot hold 10,000 streams on this box whatever its code does.
``--workers 2`` splits them over two processes (about 5,000 each): the gateway as a whole.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.harness.fleet import start_gateway, stop_all
from loadtest.harness.ports import free_port
from loadtest.harness.processes import ManagedProcess, spawn, wait_ready
from loadtest.harness.procfs import process_tree, rss_kib
from loadtest.report import percentile

__all__ = ["main"]

_BODY = json.dumps(
    {"model": "zero", "messages": [{"role": "user", "content": "hi"}], "stream": True}
).encode()


def _request(host: str, port: int) -> bytes:
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(_BODY)}\r\n\r\n"
    ).encode() + _BODY


@dataclass
class Run:
    ok: int = 0
    failed: int = 0
    first_event_s: list[float] = field(default_factory=list)
    gaps_s: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)


async def _stream(host: str, port: int, run: Run, timeout_s: float) -> None:
    started = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                writer.write(_request(host, port))
                last = None
                gaps: list[float] = []
                first = None
                while True:
                    data = await reader.read(65536)
                    if not data:
                        raise ConnectionError("closed before [DONE]")
                    if b"data: " not in data:
                        if data.startswith(b"HTTP/1.1 ") and not data.startswith(b"HTTP/1.1 200"):
                            raise ConnectionError(data[:12].decode(errors="replace"))
                        continue
                    now = time.perf_counter()
                    if first is None:
                        first = now - started
                    else:
                        gaps.append(now - last)  # type: ignore[operator]
                    last = now
                    if b"[DONE]" in data:
                        break
            finally:
                writer.close()
        run.ok += 1
        run.first_event_s.append(first or 0.0)
        run.gaps_s.extend(gaps)
    except (OSError, TimeoutError) as exc:
        run.failed += 1
        key = type(exc).__name__ + (f": {exc}"[:60] if str(exc) else "")
        run.errors[key] = run.errors.get(key, 0) + 1


def _tree_rss_kib(pid: int) -> int:
    """The gateway's resident memory: its process and, with ``--workers``, every worker."""
    return sum(rss_kib(p) or 0 for p in process_tree(pid))


async def _watch_rss(pid: int | None, peak: list[int], stop: asyncio.Event) -> None:
    while pid is not None and not stop.is_set():
        peak[0] = max(peak[0], _tree_rss_kib(pid))
        await asyncio.sleep(0.25)


async def _run(url: str, streams: int, ramp_s: float, timeout_s: float, pid: int | None) -> dict[str, Any]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    run = Run()
    before = _tree_rss_kib(pid) if pid else None
    peak = [before or 0]
    stop = asyncio.Event()
    watcher = asyncio.ensure_future(_watch_rss(pid, peak, stop))
    tasks = []
    per_tick = max(1, int(streams / (ramp_s / 0.05)))
    for i in range(0, streams, per_tick):
        tasks += [asyncio.ensure_future(_stream(host, int(port), run, timeout_s))
                  for _ in range(min(per_tick, streams - i))]  # fmt: skip
        await asyncio.sleep(0.05)
    await asyncio.gather(*tasks)
    stop.set()
    await watcher

    def ms(values: list[float], q: float) -> float:
        return round((percentile(values, q) or 0) * 1000, 1)

    return {
        "streams": streams, "ok": run.ok, "failed": run.failed, "errors": run.errors,
        "first_event_p50_ms": ms(run.first_event_s, 50), "first_event_p99_ms": ms(run.first_event_s, 99),
        "gap_p50_ms": ms(run.gaps_s, 50), "gap_p99_ms": ms(run.gaps_s, 99),
        "rss_before_mib": round(before / 1024, 1) if before else None,
        "rss_peak_mib": round(peak[0] / 1024, 1) if pid else None,
    }  # fmt: skip


async def _upstream(interval_ms: float) -> ManagedProcess:
    port = free_port()
    argv = [sys.executable, "-m", "loadtest.zero_upstream", "--port", str(port),
            "--chunk-interval-ms", str(interval_ms)]  # fmt: skip
    proc = await spawn("zero-upstream", f"http://127.0.0.1:{port}", argv, Path(tempfile.mkdtemp()))
    await wait_ready(proc, "/health", 20)
    return proc


async def run(args: argparse.Namespace) -> dict[str, Any]:
    counts = [int(x) for x in args.streams.split(",")]
    timeout_s = args.interval_ms / 1000 * 9 + args.ramp_s + 60
    config = Path(tempfile.mkdtemp(prefix="streams-")) / "gateway.yaml"
    # The pool caps are for real engines (a replica runs ~256-1024 sequences); this upstream has none.
    limits = {"upstream_connections": 20_000, "upstream_connections_per_endpoint": 0}
    config.write_text(json.dumps({"limits": limits, "timeouts": {"idle_s": 120}}))
    rows = []
    upstream = await _upstream(args.interval_ms)
    try:
        for count in counts:
            direct = await _run(upstream.url, count, args.ramp_s, timeout_s, None)
            direct["path"] = "direct"
            rows.append(direct)
            print(json.dumps(direct), file=sys.stderr, flush=True)
            flags = ["--policy", "round-robin", "--config", str(config), "--workers", str(args.workers)]
            gateway = await start_gateway([upstream.url], flags)
            try:
                through = await _run(gateway.url, count, args.ramp_s, timeout_s, gateway.process.pid)
            finally:
                await stop_all([gateway])
            through["path"] = "gateway"
            through["gap_p99_vs_direct"] = round(through["gap_p99_ms"] / max(0.1, direct["gap_p99_ms"]), 3)
            rows.append(through)
            print(json.dumps(through), file=sys.stderr, flush=True)
    finally:
        await stop_all([upstream])
    return {"interval_ms": args.interval_ms, "ramp_s": args.ramp_s, "workers": args.workers, "rows": rows}


def markdown(out: dict[str, Any]) -> str:
    lines = [
        "| streams | path | completed | failed | first event p50 / p99 ms | gap p50 / p99 ms "
        "| gap p99 vs direct | gateway RSS before → peak MiB |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in out["rows"]:
        rss = f"{r['rss_before_mib']} → {r['rss_peak_mib']}" if r["path"] == "gateway" else "–"
        lines.append(
            f"| {r['streams']:,} | {r['path']} | {r['ok']:,} | {r['failed']} | {r['first_event_p50_ms']} / "
            f"{r['first_event_p99_ms']} | {r['gap_p50_ms']} / {r['gap_p99_ms']} | "
            f"{r.get('gap_p99_vs_direct', '–')} | {rss} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--streams", default="1000,5000,9000")
    parser.add_argument("--interval-ms", type=float, default=2000.0)
    parser.add_argument("--ramp-s", type=float, default=6.0, help="open the streams over this long")
    parser.add_argument("--workers", type=int, default=1, help="gateway worker processes (RSS: all of them)")
    parser.add_argument("--out", default="bench-results/streams")
    args = parser.parse_args(argv)
    from gateway.http.server import install_uvloop

    install_uvloop()
    out = asyncio.run(run(args))
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "streams.json").write_text(json.dumps(out, indent=1))
    print(markdown(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
