"""The fault runs' tables: one column per scenario (rich on a terminal, markdown for the docs)."""

from __future__ import annotations

from typing import Any

__all__ = ["markdown_table", "print_table"]


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def _pairs(values: dict[str, float]) -> str:
    return ", ".join(f"{k}:{v:g}" for k, v in values.items()) or "-"


def _total(values: dict[str, float]) -> str:
    return f"{sum(values.values()):g}" if values else "-"


def _target(r: dict[str, Any], key: str) -> str:
    if key not in r["targets"]:
        return "-"
    return "yes" if r["targets"][key] else "NO"


def _cells(r: dict[str, Any]) -> dict[str, str]:
    ej = r["ejection"] or {}
    lat = r["latency_ms"]
    gw = r["gateway"]
    return {
        "faulted": r["faulted_endpoint"] or ("redis" if r["scenario"] == "redis" else "-"),
        "injected at (s)": _fmt(r["inject_at_s"]),
        "sent / ok / failed": f"{r['sent']} / {r['ok']} / {r['failed']}",
        "failed by reason": _pairs(r["failed_by_reason"]),
        "failed before 1st byte": str(r["failed_before_first_byte"]),
        "failed after role chunk, before content": str(r["failed_before_content"]),
        "failed mid-stream": str(r["failed_mid_stream"]),
        "5xx responses": str(r["responses_5xx"]),
        "last sent to faulted (s)": _fmt(ej.get("last_sent_s")),
        "ejected after (s)": _fmt(ej.get("ejected_after_s")) if ej else "-",
        "attempts to faulted after inj.": _fmt(ej.get("attempts_after_injection")),
        "gateway marked it out after (s)": _fmt(ej.get("gateway_marked_out_s")),
        "E2E p50 before / after (ms)": f"{_fmt(lat['before']['p50'])} / {_fmt(lat['after']['p50'])}",
        "E2E p99 before / after (ms)": f"{_fmt(lat['before']['p99'])} / {_fmt(lat['after']['p99'])}",
        "gateway retries": _pairs(gw["retries"]),
        "redis / session fallbacks": f"{_total(gw['redis_fallbacks'])} / {_total(gw['session_fallbacks'])}",
        "client send lag p99 / max (ms)": "{p99} / {max}".format(**r["client_send_lag_ms"]),
        "target: 0 failures before content": _target(r, "no_failures_before_streaming"),
        "target: ejected <= 2 s": _target(r, "ejection_within_2s"),
        "target: Redis outage 0 5xx": _target(r, "no_5xx"),
    }


def _rows(results: list[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """(label, one cell per scenario), shared by the rich and markdown tables."""
    cells = [_cells(r) for r in results]
    return [(label, [c[label] for c in cells]) for label in cells[0]] if cells else []


def print_table(results: list[dict[str, Any]], console: Any = None) -> None:
    """Rich table, one column per scenario."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="llm-gateway fault runs")
    table.add_column("metric", style="bold")
    for r in results:
        table.add_column(r["scenario"], justify="right")
    for label, cells in _rows(results):
        table.add_row(label, *cells)
    if console is None:
        console = Console()
        if not console.is_terminal:  # a pipe or a log file: do not squeeze the table into 80 columns
            console = Console(width=60 + 30 * len(results))
    console.print(table)


def markdown_table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| metric | " + " | ".join(r["scenario"] for r in results) + " |",
        "|---|" + "---:|" * len(results),
    ]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in _rows(results)]
    return "\n".join(lines) + "\n"
