"""``wrk`` as a closed-loop load generator: run it with a Lua script, read what it printed.

wrk's text output is parsed (Requests/sec, the ``--latency`` distribution, ``Socket
errors``, ``Non-2xx or 3xx responses``) and cross-checked against the exact numbers a
script's ``done()`` prints (``WRK_SUMMARY {json}``, as ``loadtest/wrk/*.lua`` do).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import resource
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["WrkResult", "parse_wrk_output", "run_wrk"]


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


async def run_wrk(
    wrk: str, url: str, script: Path, *, threads: int, connections: int, duration_s: float
) -> tuple[WrkResult, str]:
    """One ``wrk`` run of ``script`` against ``url``; its parsed result and its raw output.

    ``wrk_cpu_s`` is the CPU that wrk itself used (from this process's children's rusage).
    """
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
