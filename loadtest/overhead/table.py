"""The overhead table: one row per target and variant, against the direct run of the variant."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loadtest.harness.wrk import WrkResult

__all__ = ["HEADER", "Row", "added", "cpu_per_1k", "line", "markdown_table"]


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


def _fmt(value: float | None, spec: str, signed: bool = False) -> str:
    if value is None:
        return "-"
    return format(value, ("+" if signed else "") + spec)


def added(row: Row, direct: Row | None) -> dict[str, float | None]:
    w, d = row.wrk, direct.wrk if direct else None
    if w is None or d is None or row.kind == "direct":
        return {"ratio": 1.0 if row.kind == "direct" else None, "added_p50_ms": None, "added_p99_ms": None}
    return {
        "ratio": w.req_per_s / d.req_per_s if d.req_per_s else None,
        "added_p50_ms": w.p50_ms - d.p50_ms if w.p50_ms is not None and d.p50_ms is not None else None,
        "added_p99_ms": w.p99_ms - d.p99_ms if w.p99_ms is not None and d.p99_ms is not None else None,
    }


def cpu_per_1k(cpu_s: float | None, requests: int) -> float | None:
    return cpu_s / requests * 1e6 if cpu_s is not None and requests else None  # ms per 1k requests


HEADER = (
    f"{'target':<32} {'variant':<11} {'req/s':>9} {'x direct':>8} {'p50 ms':>7} {'p99 ms':>7} "
    f"{'+p50 ms':>8} {'+p99 ms':>8} {'rtr cpu':>8} {'ms/1k':>6}  status"
)


def _skip_text(row: Row) -> str:
    return row.note if row.note.startswith("FAILED") else f"skipped: {row.note}"


def line(row: Row, direct: Row | None) -> str:
    w = row.wrk
    if w is None:
        return f"{row.target:<32} {row.variant:<11} {'-':>9}  {_skip_text(row)}"
    extra = added(row, direct)
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
        f"{_fmt(cpu_pct, '.0f'):>7}% {_fmt(cpu_per_1k(row.router_cpu_s, w.requests), '.0f'):>6}  {status}"
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
        extra = added(row, direct_of.get(row.variant))
        cpu = row.router_cpu_s / w.duration_s * 100 if row.router_cpu_s is not None and w.duration_s else None
        status = "**ERR**" if row.flagged else "ok"
        cpu_text = f"{cpu:.0f}%" if cpu is not None else "–"
        lines.append(
            f"| {row.target} | {row.variant} | {w.req_per_s:,.0f} | {_fmt(extra['ratio'], '.2f')} "
            f"| {_fmt(w.p50_ms, '.2f')} | {_fmt(w.p99_ms, '.2f')} "
            f"| {_fmt(extra['added_p50_ms'], '.2f', True)} | {_fmt(extra['added_p99_ms'], '.2f', True)} "
            f"| {cpu_text} | {_fmt(cpu_per_1k(row.router_cpu_s, w.requests), '.0f')} | {status} |"
        )
    return "\n".join(lines)
