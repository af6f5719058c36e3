"""Gateway overhead against a zero-work upstream: direct vs gateway vs peer routers, one run.

``python -m loadtest.overhead [--duration 10] [--connections 64] [--workers-list 1,2]
[--policies round-robin,default] [--peers sglang-router,vllm-router] [--out bench-results/overhead]``

One run starts :mod:`loadtest.zero_upstream` (answers at once; the streaming variant sends
8 SSE chunks), then for each target — the upstream directly, ``llm-gateway serve`` for every
policy x ``--workers`` combination, and each peer router (``round_robin``) — checks one
non-streaming and one streaming answer by hand, then runs ``wrk`` (a separate process:
``-t1 -cC -dDs --latency -s loadtest/wrk/chat.lua`` and ``chat_stream.lua``) after a short
warm-up. wrk's text output is parsed (Requests/sec, the ``--latency`` distribution,
``Socket errors``, ``Non-2xx or 3xx responses``) and cross-checked against the exact
numbers the scripts' ``done()`` prints (``WRK_SUMMARY {json}``). A run with any socket
error or non-2xx answer is flagged ``ERR`` in the table and ``"flagged": true`` in the
JSON, never dropped.

Added latency is the target's percentile minus the direct run's percentile of the same
variant. CPU seconds of the router process tree and of the upstream are sampled from
``/proc`` around each wrk run, so "CPU ms per 1k requests" shows where the cores went.

``--profile`` additionally records the first gateway configuration with py-spy (a
separate wrk run, not part of the table: sampling costs the target some throughput) and
prints its hottest functions. Everything is bound to 127.0.0.1; every process started
here is stopped by its PID (SIGTERM, then SIGKILL of its own process group).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import resource
import shutil
import signal
import socket
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.peers import PEER_ROUTERS, PeerStartError, peer_available, start_peer

__all__ = ["WrkResult", "main", "parse_wrk_output", "run_overhead"]

REPO_ROOT = Path(__file__).resolve().parent.parent
WRK_DIR = Path(__file__).resolve().parent / "wrk"
VARIANTS = {"chat": "chat.lua", "chat_stream": "chat_stream.lua"}
MODEL = "zero"
STREAM_EVENTS = 9  # 8 chunks + data: [DONE]
_CLK_TCK = os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------- wrk output


@dataclass
class WrkResult:
    req_per_s: float
    requests: int
    duration_s: float
    p50_ms: float | None
    p75_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    p999_ms: float | None = None
    mean_ms: float | None = None
    max_ms: float | None = None
    socket_errors: dict[str, int] = field(default_factory=dict)
    non_2xx: int = 0
    wrk_cpu_s: float | None = None

    @property
    def errors(self) -> int:
        return sum(self.socket_errors.values()) + self.non_2xx

    @property
    def flagged(self) -> bool:
        return self.errors > 0 or self.requests == 0


_UNITS_MS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3, "h": 3600e3}
_TIME = r"([\d.]+)(us|ms|s|m|h)"


def _to_ms(value: str, unit: str) -> float:
    return float(value) * _UNITS_MS[unit]


def parse_wrk_output(text: str) -> WrkResult:
    """Parse wrk 4.x ``--latency`` output (plus the optional ``WRK_SUMMARY`` line)."""
    rps = re.search(r"^Requests/sec:\s+([\d.]+)", text, re.M)
    total = re.search(r"^\s*(\d+) requests in ([\d.]+)(us|ms|s|m|h)", text, re.M)
    dist = {
        q: _to_ms(m.group(1), m.group(2))
        for q, m in ((q, re.search(rf"^\s+{q}%\s+{_TIME}", text, re.M)) for q in ("50", "75", "90", "99"))
        if m
    }
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    socket_errors = (
        dict(zip(("connect", "read", "write", "timeout"), map(int, sock.groups()), strict=True))
        if sock
        else {"connect": 0, "read": 0, "write": 0, "timeout": 0}
    )
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    result = WrkResult(
        req_per_s=float(rps.group(1)) if rps else 0.0,
        requests=int(total.group(1)) if total else 0,
        duration_s=_to_ms(total.group(2), total.group(3)) / 1e3 if total else 0.0,
        p50_ms=dist.get("50"),
        p75_ms=dist.get("75"),
        p90_ms=dist.get("90"),
        p99_ms=dist.get("99"),
        socket_errors=socket_errors,
        non_2xx=int(non2xx.group(1)) if non2xx else 0,
    )
    summary = re.search(r"^WRK_SUMMARY (\{.*\})\s*$", text, re.M)
    if summary:
        data = json.loads(summary.group(1))
        # Exact microsecond percentiles (the text rounds to 2 decimals of its own unit).
        result.p50_ms = data["p50_us"] / 1e3
        result.p90_ms = data["p90_us"] / 1e3
        result.p99_ms = data["p99_us"] / 1e3
        result.p999_ms = data["p999_us"] / 1e3
        result.mean_ms = data["mean_us"] / 1e3
        result.max_ms = data["max_us"] / 1e3
        # done() sees status >= 400 separately from the text's "Non-2xx or 3xx" count.
        result.non_2xx = max(result.non_2xx, int(data["errors"]["status"]))
        for key in ("connect", "read", "write", "timeout"):
            result.socket_errors[key] = max(result.socket_errors[key], int(data["errors"][key]))
    return result


# --------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Proc:
    """A process this module started (in its own session, so its children share its group)."""

    name: str
    url: str
    process: asyncio.subprocess.Process
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, max_chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-max_chars:]
        return ""

    async def stop(self, grace_s: float = 5.0) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), grace_s)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.pid, signal.SIGKILL)  # our own session: the pid is the pgid
                await self.process.wait()
        # Children (SO_REUSEPORT workers) that outlived their parent: same group, ours.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)


async def spawn(
    name: str,
    url: str,
    argv: list[str],
    log_dir: Path,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
) -> Proc:
    log_path = log_dir / f"{name}.log"
    with log_path.open("wb") as log_file:
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log_file,
            stderr=asyncio.subprocess.STDOUT,
            env=env or {**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
            cwd=cwd,
        )
    return Proc(name, url, process, log_path)


async def wait_ready(proc: Proc, path: str, timeout_s: float = 30.0, streak: int = 1) -> None:
    """Poll ``path`` on fresh connections until it answers 200 ``streak`` times in a row."""
    deadline = time.monotonic() + timeout_s
    ok = 0
    connector = aiohttp.TCPConnector(force_close=True)
    timeout = aiohttp.ClientTimeout(total=1)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as session:
        while time.monotonic() < deadline:
            if proc.process.returncode is not None:
                raise RuntimeError(f"{proc.name} exited with {proc.process.returncode}:\n{proc.log_tail()}")
            status = 0
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(proc.url + path) as resp:
                    status = resp.status
            ok = ok + 1 if status == 200 else 0
            if ok >= streak:
                return
            await asyncio.sleep(0.02 if status == 200 else 0.1)
    raise RuntimeError(f"{proc.name} not ready at {path} after {timeout_s}s:\n{proc.log_tail()}")


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (Linux ``/proc/PID/task/*/children``)."""
    pids, todo = [], [pid]
    while todo:
        current = todo.pop()
        pids.append(current)
        for task in Path(f"/proc/{current}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                todo.extend(int(p) for p in task.read_text().split())
    return pids


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime + stime
    return total / _CLK_TCK


# --------------------------------------------------------------------------- checks and load


async def check_target(base_url: str) -> list[str]:
    """One non-streaming and one streaming request by hand; returns the problems found."""
    problems = []
    url = base_url + "/v1/chat/completions"
    messages = [{"role": "user", "content": "check"}]
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout, trust_env=False) as session:
        try:
            async with session.post(url, json={"model": MODEL, "messages": messages}) as resp:
                body = await resp.read()
                if resp.status != 200 or not json.loads(body).get("choices"):
                    problems.append(f"non-stream: HTTP {resp.status} {body[:200]!r}")
            async with session.post(url, json={"model": MODEL, "messages": messages, "stream": True}) as resp:
                text = (await resp.read()).decode(errors="replace")
                events = [line for line in text.splitlines() if line.startswith("data:")]
                if resp.status != 200 or len(events) != STREAM_EVENTS or events[-1].strip() != "data: [DONE]":
                    problems.append(
                        f"stream: HTTP {resp.status}, {len(events)} data events (want {STREAM_EVENTS}),"
                        f" ends {events[-1:]!r}"
                    )
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            problems.append(f"request failed: {exc!r}")
    return problems


async def run_wrk(
    wrk: str, url: str, variant: str, *, threads: int, connections: int, duration_s: float
) -> tuple[WrkResult, str]:
    script = WRK_DIR / VARIANTS[variant]
    argv = [
        wrk,
        f"-t{threads}",
        f"-c{connections}",
        f"-d{max(1, round(duration_s))}s",
        "--latency",
        "--timeout",
        "10s",
        "-s",
        str(script),
        url,
    ]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), duration_s + 30)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise RuntimeError(f"wrk did not finish: {' '.join(argv)}") from None
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    text = out.decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"wrk exited with {proc.returncode}:\n{text}")
    result = parse_wrk_output(text)
    result.wrk_cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return result, text


@dataclass
class Row:
    target: str
    kind: str  # direct | gateway | peer
    variant: str
    wrk: WrkResult | None
    router_cpu_s: float | None = None
    upstream_cpu_s: float | None = None
    problems: list[str] = field(default_factory=list)
    note: str = ""
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def flagged(self) -> bool:
        return bool(self.problems) or self.wrk is None or self.wrk.flagged


class Bench:
    def __init__(self, args: argparse.Namespace, upstream: Proc, log_dir: Path) -> None:
        self.args = args
        self.upstream = upstream
        self.log_dir = log_dir
        self.rows: list[Row] = []
        self.wrk = args.wrk

    async def measure(
        self, target: str, kind: str, url: str, router_pid: int | None, config: dict[str, Any]
    ) -> None:
        problems = await check_target(url)
        if problems:
            print(f"  ! {target}: {'; '.join(problems)}", flush=True)
        upstream_pids = process_tree(self.upstream.pid)
        for variant in self.args.variants:
            if self.args.warmup > 0:
                await run_wrk(
                    self.wrk,
                    url,
                    variant,
                    threads=self.args.threads,
                    connections=self.args.connections,
                    duration_s=self.args.warmup,
                )
            router_pids = process_tree(router_pid) if router_pid else []
            cpu_r0, cpu_u0 = cpu_seconds(router_pids), cpu_seconds(upstream_pids)
            result, text = await run_wrk(
                self.wrk,
                url,
                variant,
                threads=self.args.threads,
                connections=self.args.connections,
                duration_s=self.args.duration,
            )
            cpu_r1, cpu_u1 = cpu_seconds(router_pids), cpu_seconds(upstream_pids)
            (self.log_dir / f"wrk-{_slug(target)}-{variant}.txt").write_text(text)
            row = Row(
                target,
                kind,
                variant,
                result,
                router_cpu_s=(cpu_r1 - cpu_r0) if router_pid else None,
                upstream_cpu_s=cpu_u1 - cpu_u0,
                problems=list(problems),
                config=config,
            )
            self.rows.append(row)
            print("  " + _line(row, self.direct(variant)), flush=True)

    def direct(self, variant: str) -> Row | None:
        for row in self.rows:
            if row.kind == "direct" and row.variant == variant and row.wrk is not None:
                return row
        return None


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_")


# --------------------------------------------------------------------------- table


def _fmt(value: float | None, spec: str, signed: bool = False) -> str:
    if value is None:
        return "-"
    return format(value, ("+" if signed else "") + spec)


def _added(row: Row, direct: Row | None) -> dict[str, float | None]:
    w, d = row.wrk, direct.wrk if direct else None
    if w is None or d is None or row.kind == "direct":
        return {"ratio": 1.0 if row.kind == "direct" else None, "added_p50_ms": None, "added_p99_ms": None}
    return {
        "ratio": w.req_per_s / d.req_per_s if d.req_per_s else None,
        "added_p50_ms": w.p50_ms - d.p50_ms if w.p50_ms is not None and d.p50_ms is not None else None,
        "added_p99_ms": w.p99_ms - d.p99_ms if w.p99_ms is not None and d.p99_ms is not None else None,
    }


def _cpu_per_1k(cpu_s: float | None, requests: int) -> float | None:
    return cpu_s / requests * 1e6 if cpu_s is not None and requests else None  # ms per 1k requests


HEADER = (
    f"{'target':<32} {'variant':<11} {'req/s':>9} {'x direct':>8} {'p50 ms':>7} {'p99 ms':>7} "
    f"{'+p50 ms':>8} {'+p99 ms':>8} {'rtr cpu':>8} {'ms/1k':>6}  status"
)


def _skip_text(row: Row) -> str:
    return row.note if row.note.startswith("FAILED") else f"skipped: {row.note}"


def _line(row: Row, direct: Row | None) -> str:
    w = row.wrk
    if w is None:
        return f"{row.target:<32} {row.variant:<11} {'-':>9}  {_skip_text(row)}"
    extra = _added(row, direct)
    cpu_pct = row.router_cpu_s / w.duration_s * 100 if row.router_cpu_s is not None and w.duration_s else None
    if row.flagged:
        parts = [f"{k} {v}" for k, v in w.socket_errors.items() if v]
        if w.non_2xx:
            parts.append(f"non-2xx {w.non_2xx}")
        parts += row.problems
        status = "ERR " + ", ".join(parts or ["no requests"])
    else:
        status = "ok"
    return (
        f"{row.target:<32} {row.variant:<11} {w.req_per_s:>9,.0f} {_fmt(extra['ratio'], '.2f'):>8} "
        f"{_fmt(w.p50_ms, '.2f'):>7} {_fmt(w.p99_ms, '.2f'):>7} "
        f"{_fmt(extra['added_p50_ms'], '.2f', True):>8} {_fmt(extra['added_p99_ms'], '.2f', True):>8} "
        f"{_fmt(cpu_pct, '.0f'):>7}% {_fmt(_cpu_per_1k(row.router_cpu_s, w.requests), '.0f'):>6}  {status}"
    )


def markdown_table(rows: list[Row], direct_of: dict[str, Row | None]) -> str:
    lines = [
        "| target | variant | req/s | × direct | p50 ms | p99 ms | added p50 ms | added p99 ms "
        "| router CPU | router CPU ms / 1k req | status |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        w = row.wrk
        if w is None:
            lines.append(f"| {row.target} | {row.variant} | – | | | | | | | | {_skip_text(row)} |")
            continue
        extra = _added(row, direct_of.get(row.variant))
        cpu = row.router_cpu_s / w.duration_s * 100 if row.router_cpu_s is not None and w.duration_s else None
        status = "**ERR**" if row.flagged else "ok"
        cpu_text = f"{cpu:.0f}%" if cpu is not None else "–"
        lines.append(
            f"| {row.target} | {row.variant} | {w.req_per_s:,.0f} | {_fmt(extra['ratio'], '.2f')} "
            f"| {_fmt(w.p50_ms, '.2f')} | {_fmt(w.p99_ms, '.2f')} "
            f"| {_fmt(extra['added_p50_ms'], '.2f', True)} | {_fmt(extra['added_p99_ms'], '.2f', True)} "
            f"| {cpu_text} | {_fmt(_cpu_per_1k(row.router_cpu_s, w.requests), '.0f')} | {status} |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- profiling


_AREAS = (
    (
        "aiohttp client",
        re.compile(r"\(aiohttp/(client|connector|client_reqrep|client_proto|cookiejar|tracing)"),
    ),
    ("aiohttp server", re.compile(r"\(aiohttp/(web|http_parser|base_protocol)")),
    ("aiohttp shared", re.compile(r"\(aiohttp/")),
    ("prometheus_client", re.compile(r"\(prometheus_client/")),
    ("gateway + policies", re.compile(r"\((gateway|policies)/")),
    ("asyncio / event loop", re.compile(r"\(asyncio/|Runner\.run")),
)


def _area(frame: str) -> str:
    for name, pattern in _AREAS:
        if pattern.search(frame):
            return name
    return "other"


def summarize_collapsed(path: Path, top: int = 20) -> dict[str, list[tuple[str, float]]]:
    """Self and inclusive shares of the hottest frames in a py-spy ``--format raw`` file.

    ``areas`` groups self time by where the code lives (aiohttp client vs server, the
    gateway's own modules, prometheus_client, the event loop).
    """
    area_counts: Counter[str] = Counter()
    self_counts: Counter[str] = Counter()
    incl_counts: Counter[str] = Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]
        # Drop the line numbers so that one function is one row.
        if frames:
            self_counts[frames[-1]] += count
            area_counts[_area(frames[-1])] += count
        for frame in set(frames):
            incl_counts[frame] += count
    if not total:
        return {"self": [], "inclusive": [], "samples": []}

    def share(counter: Counter[str]) -> list[tuple[str, float]]:
        return [(name, round(100.0 * n / total, 1)) for name, n in counter.most_common(top)]

    return {
        "self": share(self_counts),
        "inclusive": share(incl_counts),
        "areas": share(area_counts),
        "samples": [("total", total)],
    }


async def profile_gateway(bench: Bench, name: str, url: str, pid: int, out: Path) -> dict[str, Any]:
    py_spy = bench.args.py_spy
    results: dict[str, Any] = {}
    for variant in bench.args.variants:
        raw = out / f"profile-{_slug(name)}-{variant}.txt"
        svg = out / f"profile-{_slug(name)}-{variant}.svg"
        duration = max(2, round(bench.args.duration))
        spies = [
            await asyncio.create_subprocess_exec(
                py_spy, "record", "--pid", str(pid), "--duration", str(duration), "--rate", "250",
                "--nonblocking", "--format", fmt, "--output", str(path),
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            )
            for fmt, path in (("raw", raw), ("flamegraph", svg))
        ]  # fmt: skip
        await asyncio.sleep(0.5)
        wrk_result, _ = await run_wrk(
            bench.wrk,
            url,
            variant,
            threads=bench.args.threads,
            connections=bench.args.connections,
            duration_s=duration,
        )
        for spy in spies:
            await spy.wait()
        summary = summarize_collapsed(raw) if raw.exists() else {}
        results[variant] = {"req_per_s_while_profiled": wrk_result.req_per_s, **summary}
        print(f"\nprofile {name} {variant} ({wrk_result.req_per_s:,.0f} req/s while sampled): {raw}")
        for frame, pct in summary.get("areas", []):
            print(f"  area {pct:5.1f}%  {frame}")
        for frame, pct in summary.get("self", [])[:15]:
            print(f"  self {pct:5.1f}%  {frame}")
    return results


# --------------------------------------------------------------------------- main


async def run_overhead(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_dir = out / "logs"
    log_dir.mkdir(exist_ok=True)
    upstream_port = free_port()
    upstream_url = f"http://127.0.0.1:{upstream_port}"
    argv = [sys.executable, "-m", "loadtest.zero_upstream", "--port", str(upstream_port)]
    argv += ["--workers", str(args.upstream_workers), "--model", MODEL]
    upstream = await spawn("zero-upstream", upstream_url, argv, log_dir)
    started_procs: list[Proc] = [upstream]
    notes: list[str] = []
    failures: list[str] = []
    profile: dict[str, Any] = {}
    bench = Bench(args, upstream, log_dir)
    try:
        await wait_ready(upstream, "/health", streak=2 * args.upstream_workers)
        print(f"zero upstream at {upstream_url} ({args.upstream_workers} worker(s)); {_machine()}")
        print(
            f"wrk -t{args.threads} -c{args.connections} -d{args.duration:g}s --latency "
            f"(+{args.warmup:g}s warm-up per variant)\n"
        )
        print(HEADER)
        await bench.measure(
            "direct", "direct", upstream_url, None, {"upstream_workers": args.upstream_workers}
        )

        first_gateway: tuple[str, str, int] | None = None
        gw_env, gw_cwd = None, None
        if args.gateway_src:
            # Benchmark another checkout of the gateway (e.g. `git archive` of a commit) with the
            # same interpreter: its directory goes first on the import path.
            src = gw_cwd = str(Path(args.gateway_src).resolve())
            gw_env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": src}
            gw_env["PYTHONPATH"] += os.pathsep + os.environ.get("PYTHONPATH", "")
        for policy in args.policies:
            for workers in args.workers_list:
                name = f"llm-gateway {policy} w{workers}"
                port = free_port()
                gw_argv = [sys.executable, "-m", "gateway.cli", "serve", "--endpoint", upstream_url]
                gw_argv += ["--port", str(port), "--workers", str(workers)]
                if policy != "default":
                    gw_argv += ["--policy", policy]
                gateway = await spawn(
                    _slug(name), f"http://127.0.0.1:{port}", gw_argv, log_dir, env=gw_env, cwd=gw_cwd
                )
                started_procs.append(gateway)
                try:
                    await wait_ready(gateway, "/ready", streak=4 * workers)
                    await bench.measure(
                        name, "gateway", gateway.url, gateway.pid, {"policy": policy, "workers": workers}
                    )
                    if args.profile and first_gateway is None and workers == 1:
                        first_gateway = (name, gateway.url, gateway.pid)
                        profile = await profile_gateway(bench, name, gateway.url, gateway.pid, out)
                        print("\n" + HEADER)
                except RuntimeError as exc:
                    notes.append(f"{name}: {exc}")
                    failures.append(name)
                    print(f"  ! {name}: {exc}", flush=True)
                    for variant in args.variants:
                        if not any(r.target == name and r.variant == variant for r in bench.rows):
                            bench.rows.append(Row(name, "gateway", variant, None, note="FAILED (see notes)"))
                finally:
                    await gateway.stop()
                    started_procs.remove(gateway)

        for peer_name in args.peers:
            if peer_name not in PEER_ROUTERS or not peer_available(peer_name):
                note = f"{peer_name} not installed (.venv-peers or LLMGW_PEERS_PYTHON): skipped"
                notes.append(note)
                for variant in args.variants:
                    bench.rows.append(Row(peer_name, "peer", variant, None, note="not installed"))
                print(f"  - {note}", flush=True)
                continue
            try:
                peer = await start_peer(
                    peer_name, free_port(), [upstream_url], "round_robin", log_dir=log_dir
                )
            except PeerStartError as exc:
                notes.append(f"{peer_name}: {exc}")
                failures.append(peer_name)
                print(f"  ! {peer_name} did not start: {str(exc)[:500]}", flush=True)
                for variant in args.variants:
                    bench.rows.append(Row(peer_name, "peer", variant, None, note="FAILED to start"))
                continue
            try:
                await bench.measure(
                    f"{peer_name} round_robin", "peer", peer.url, peer.pid, {"policy": "round_robin"}
                )
            finally:
                await peer.stop()
    finally:
        for proc in started_procs:
            await proc.stop()

    rows = bench.rows
    direct_of = {v: bench.direct(v) for v in args.variants}
    ordered = sorted(rows, key=lambda r: (args.variants.index(r.variant), rows.index(r)))
    print("\n" + HEADER)
    for row in ordered:
        print(_line(row, direct_of.get(row.variant)))
    flagged = [r for r in rows if r.wrk is not None and r.flagged]
    if flagged:
        print(f"\n{len(flagged)} run(s) had errors (ERR): their numbers are not comparable.")
    for note in notes:
        print(f"note: {note}")
    if failures:
        print(f"\nFAILED to start or measure: {', '.join(failures)}")
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
        "rows": [
            {
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
                "router_cpu_ms_per_1k": _cpu_per_1k(r.router_cpu_s, r.wrk.requests) if r.wrk else None,
                **_added(r, direct_of.get(r.variant)),
            }
            for r in ordered
        ],
        "notes": notes,
        "failures": failures,
        "profile": profile,
        "markdown": table,
    }
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out / f"overhead-{stamp}.json").write_text(json.dumps(report, indent=2))
    (out / "overhead-latest.json").write_text(json.dumps(report, indent=2))
    (out / "overhead-latest.md").write_text(table + "\n")
    print(f"\nwrote {out / f'overhead-{stamp}.json'} and {out / 'overhead-latest.md'}")
    return 1 if flagged or failures else 0


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
    p.add_argument("--variants", type=_csv(str), default=list(VARIANTS), help="chat,chat_stream")
    p.add_argument("--upstream-workers", type=int, default=2, help="zero upstream processes (SO_REUSEPORT)")
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


if __name__ == "__main__":
    sys.exit(main())
