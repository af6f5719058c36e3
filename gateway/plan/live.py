"""``llm-gateway plan --live URL``: size the fleet from what a running gateway observes.

Reads the gateway's own ``/metrics``: its in-flight requests (current concurrency) and
the per-pool autoscaling signals (``gateway/fleet/autoscale.py``): healthy replicas, KV-cache
utilisation, queue depth, and how many replicas the observed load needs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["LivePool", "LiveReport", "format_live", "read_live"]


@dataclass(frozen=True, slots=True)
class LivePool:
    pool: str
    replicas: int
    desired_replicas: int
    kv_utilization: float
    kv_headroom: float
    queue_depth: float


@dataclass(frozen=True, slots=True)
class LiveReport:
    url: str
    in_flight: int
    pools: list[LivePool]

    def to_dict(self) -> dict:
        return {"url": self.url, "in_flight": self.in_flight, "pools": [asdict(p) for p in self.pools]}


def read_live(url: str, timeout_s: float = 5.0) -> LiveReport:
    """Scrape ``url``/metrics; raises ``httpx.HTTPError`` or ``ValueError`` when it cannot."""
    response = httpx.get(url.rstrip("/") + "/metrics", timeout=timeout_s, trust_env=False)
    response.raise_for_status()
    in_flight = 0.0
    by_pool: dict[str, dict[str, float]] = {}
    names = {
        "llm_gateway_pool_current_replicas": "replicas",
        "llm_gateway_pool_desired_replicas": "desired",
        "llm_gateway_pool_kv_utilization": "kv",
        "llm_gateway_pool_queue_depth": "queue",
    }
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name == "llm_gateway_endpoint_in_flight_requests":
                in_flight += sample.value
            elif sample.name in names:
                by_pool.setdefault(sample.labels.get("pool", "?"), {})[names[sample.name]] = sample.value
    if not by_pool:
        raise ValueError(f"{url} exports no llm_gateway_pool_* metrics: is it an llm-gateway?")
    pools = [
        LivePool(
            pool=pool,
            replicas=int(values.get("replicas", 0)),
            desired_replicas=int(values.get("desired", 0)),
            kv_utilization=round(values.get("kv", 0.0), 4),
            kv_headroom=round(1.0 - values.get("kv", 0.0), 4),
            queue_depth=values.get("queue", 0.0),
        )
        for pool, values in sorted(by_pool.items())
    ]
    return LiveReport(url, int(in_flight), pools)


def format_live(report: LiveReport, as_json: bool) -> str:
    if as_json:
        return json.dumps(report.to_dict(), indent=2)
    lines = [f"Live fleet behind {report.url}: {report.in_flight} requests in flight at this gateway", ""]
    lines.append(
        f"  {'pool':8} {'replicas':>8} {'needed':>7} {'KV used':>8} {'KV headroom':>12} {'queued':>7}"
    )
    for p in report.pools:
        lines.append(
            f"  {p.pool:8} {p.replicas:>8} {p.desired_replicas:>7} {p.kv_utilization:>8.0%} "
            f"{p.kv_headroom:>12.0%} {p.queue_depth:>7.0f}"
        )
    lines.append("")
    for p in report.pools:
        verdict = "enough" if p.desired_replicas <= p.replicas else f"{p.desired_replicas - p.replicas} short"
        lines.append(f"  {p.pool}: the observed load needs {p.desired_replicas} replicas ({verdict}).")
    return "\n".join(lines)
