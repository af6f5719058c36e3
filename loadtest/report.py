"""Summaries, comparison tables, JSON and plots for :class:`BenchResult` runs.

Latency percentiles only count successful requests (errors are reported
separately by status) so a fast-failing router cannot look fast.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loadtest.runner import BenchResult

__all__ = [
    "Summary",
    "markdown_table",
    "percentile",
    "plot",
    "print_comparison",
    "read_json",
    "summarize",
    "write_json",
]


def nearest_rank(sorted_values: list[float], q: float) -> float:
    """The value at rank ``q`` (0–1) of already sorted, non-empty values, without interpolation
    (cheap enough for a bootstrap's thousands of resamples)."""
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default method); None when empty."""
    if not values:
        return None
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


@dataclass
class Summary:
    """Headline numbers of one run; latencies in seconds, None when undefined."""

    name: str
    target: str
    workload: str
    requests: int
    ok: int
    errors: int
    duration_s: float
    req_per_s: float
    output_tok_per_s: float
    ttft_p50: float | None
    ttft_p90: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    e2e_p50: float | None
    e2e_p99: float | None
    prompt_tokens: int
    cached_tokens: int
    usage_hit_ratio: float | None
    replica_hit_ratio: float | None
    replica_requests: dict[str, int] = field(default_factory=dict)
    replica_requests_server: dict[str, float] = field(default_factory=dict)
    load_max_mean: float | None = None
    errors_by_status: dict[str, int] = field(default_factory=dict)
    stopped_by: str = "completed"


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def summarize(result: BenchResult) -> Summary:
    """Compute the per-run summary the tables, JSON and docs use."""
    ok = [r for r in result.records if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [x for r in ok for x in r.itls]
    e2es = [r.e2e for r in ok if r.e2e is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    out_tokens = sum(r.completion_tokens for r in ok)
    dur = result.duration_s

    client_counts = Counter(r.endpoint or "?" for r in ok)
    good_stats = [s for s in result.replica_stats if s.error is None]
    server_counts = {s.url: s.requests for s in good_stats}
    # Prefer server-side counts when the client cannot see which replica served
    # (a proxy without the endpoint header shows up as a single endpoint).
    use_server = bool(server_counts) and sum(server_counts.values()) > 0 and len(client_counts) < 2
    loads = list(server_counts.values()) if use_server else list(client_counts.values())
    mean_load = sum(loads) / len(loads) if loads else 0.0

    errors = Counter(str(r.status) if r.status else "no-response" for r in result.records if not r.ok)
    return Summary(
        name=result.name,
        target=result.target,
        workload=result.workload,
        requests=len(result.records),
        ok=len(ok),
        errors=len(result.records) - len(ok),
        duration_s=dur,
        req_per_s=len(ok) / dur if dur > 0 else 0.0,
        output_tok_per_s=out_tokens / dur if dur > 0 else 0.0,
        ttft_p50=percentile(ttfts, 50),
        ttft_p90=percentile(ttfts, 90),
        ttft_p99=percentile(ttfts, 99),
        itl_p50=percentile(itls, 50),
        itl_p99=percentile(itls, 99),
        e2e_p50=percentile(e2es, 50),
        e2e_p99=percentile(e2es, 99),
        prompt_tokens=prompt,
        cached_tokens=cached,
        usage_hit_ratio=_ratio(cached, prompt),
        replica_hit_ratio=_ratio(
            sum(s.prefix_hits for s in good_stats), sum(s.prefix_queries for s in good_stats)
        ),
        replica_requests=dict(sorted(client_counts.items())),
        replica_requests_server=server_counts,
        load_max_mean=max(loads) / mean_load if mean_load > 0 else None,
        errors_by_status=dict(sorted(errors.items())),
        stopped_by=result.stopped_by,
    )


# --------------------------------------------------------------------------- tables


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.1f}%"


def _load_counts(s: Summary) -> dict[str, Any]:
    """Counts the load ratio was computed from (server-side when the client saw one endpoint)."""
    if len(s.replica_requests) < 2 and sum(s.replica_requests_server.values()) > 0:
        return s.replica_requests_server
    return s.replica_requests


def _errors_cell(s: Summary) -> str:
    return ", ".join(f"{k}:{v}" for k, v in s.errors_by_status.items()) or "-"


def _rows(summaries: list[Summary]) -> list[tuple[str, list[str]]]:
    """Metric rows (label, one cell per run) shared by rich and markdown output."""

    def row(label: str, fn: Any) -> tuple[str, list[str]]:
        return label, [fn(s) for s in summaries]

    return [
        row("target", lambda s: s.target),
        row("requests ok / err", lambda s: f"{s.ok} / {s.errors}"),
        row("duration (s)", lambda s: f"{s.duration_s:.2f}"),
        row("throughput (req/s)", lambda s: f"{s.req_per_s:.2f}"),
        row("output tok/s", lambda s: f"{s.output_tok_per_s:.1f}"),
        row("TTFT p50 (ms)", lambda s: _ms(s.ttft_p50)),
        row("TTFT p90 (ms)", lambda s: _ms(s.ttft_p90)),
        row("TTFT p99 (ms)", lambda s: _ms(s.ttft_p99)),
        row("ITL p50 (ms)", lambda s: _ms(s.itl_p50)),
        row("ITL p99 (ms)", lambda s: _ms(s.itl_p99)),
        row("E2E p50 (ms)", lambda s: _ms(s.e2e_p50)),
        row("E2E p99 (ms)", lambda s: _ms(s.e2e_p99)),
        row("prefix hit (usage)", lambda s: _pct(s.usage_hit_ratio)),
        row("prefix hit (replicas)", lambda s: _pct(s.replica_hit_ratio)),
        row("load max/mean", lambda s: "-" if s.load_max_mean is None else f"{s.load_max_mean:.2f}"),
        row("per-replica requests", lambda s: " ".join(f"{v:g}" for v in _load_counts(s).values()) or "-"),
        row("errors by status", _errors_cell),
    ]


def print_comparison(results: list[BenchResult], console: Any = None) -> None:
    """Rich table with one column per run (e.g. direct-rr vs gateway vs router)."""
    from rich.console import Console
    from rich.table import Table

    summaries = [summarize(r) for r in results]
    table = Table(title="llm-gateway benchmark", show_lines=False)
    table.add_column("metric", style="bold")
    for s in summaries:
        table.add_column(s.name, justify="right")
    for label, cells in _rows(summaries):
        table.add_row(label, *cells)
    (console or Console()).print(table)


def markdown_table(results: list[BenchResult]) -> str:
    """GitHub-flavoured markdown version of :func:`print_comparison` (for docs)."""
    summaries = [summarize(r) for r in results]

    def esc(text: str) -> str:
        return text.replace("|", "\\|")

    lines = [
        "| metric | " + " | ".join(esc(s.name) for s in summaries) + " |",
        "|---|" + "---:|" * len(summaries),
    ]
    lines += [f"| {label} | " + " | ".join(esc(c) for c in cells) + " |" for label, cells in _rows(summaries)]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- files


def write_json(results: list[BenchResult], path: str | Path) -> Path:
    """Write summaries plus raw records, so plots can be redrawn later."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = [{"summary": asdict(summarize(r)), **r.to_dict()} for r in results]
    path.write_text(json.dumps(payload, indent=1, allow_nan=False))
    return path


def read_json(path: str | Path) -> list[BenchResult]:
    """Load results written by :func:`write_json`."""
    return [BenchResult.from_dict(d) for d in json.loads(Path(path).read_text())]


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:80]


def plot(results: list[BenchResult], out_dir: str | Path, prefix: str = "") -> list[Path]:
    """TTFT CDF per run and per-replica load bars; returns the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        ttfts = sorted(x.ttft * 1000 for x in r.records if x.ok and x.ttft is not None)
        if ttfts:
            ys = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
            ax.step(ttfts, ys, where="post", label=r.name)
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF")
    ax.grid(True, alpha=0.3)
    if results:
        ax.legend(loc="lower right", fontsize="small")
    path = out / f"{_safe(prefix)}ttft_cdf.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    paths.append(path)

    summaries = [summarize(r) for r in results]
    fig, axes = plt.subplots(1, max(1, len(results)), figsize=(4 * max(1, len(results)), 4), squeeze=False)
    for ax, s in zip(axes[0], summaries, strict=False):
        counts = _load_counts(s)
        labels = [k.rsplit("//", 1)[-1] for k in counts]
        ax.bar(range(len(counts)), list(counts.values()), color="tab:blue")
        ax.set_xticks(range(len(counts)), labels, rotation=30, ha="right", fontsize="small")
        ratio = "-" if s.load_max_mean is None else f"{s.load_max_mean:.2f}"
        ax.set_title(f"{s.name}\nmax/mean={ratio}", fontsize="small")
        ax.set_ylabel("requests")
    path = out / f"{_safe(prefix)}replica_load.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    paths.append(path)
    return paths
