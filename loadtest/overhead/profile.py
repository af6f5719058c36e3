"""``--profile``: py-spy the first gateway during an extra wrk run; where did its time go?"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from pathlib import Path
from typing import Any

from loadtest.overhead.bench import Bench, slug

__all__ = ["profile_gateway", "summarize_collapsed"]


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
        raw = out / f"profile-{slug(name)}-{variant}.txt"
        svg = out / f"profile-{slug(name)}-{variant}.svg"
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
        wrk_result, _ = await bench.wrk_run(url, variant, duration)
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
