"""Autoscaling signals: how many replicas each pool needs, from the engines' own load.

Seed 004 §7.6: "scale on queue depth, KV-cache usage, or TTFT". Per pool (``both``,
``prefill``, ``decode`` — P/D pools scale independently) each healthy replica with
fresh metrics contributes a *pressure*:

    pressure = max(kv_usage / kv_target, waiting / queue_target)

where 1.0 means "exactly at target". The pool needs ``sum(pressure) / (1 - headroom)``
replicas, rounded up, at least 1: the headroom keeps warm spare capacity for bursts
(scale-up takes minutes on GPUs). Replicas with stale metrics count as at target (1.0),
so a metrics outage neither scales a pool to zero nor doubles it. A data-parallel replica
(one pod, N ranks) is one replica: its pressure is its ranks' mean, its queue their sum —
counted per rank, a pool of two 4-rank pods read as 8 replicas and asked for 9. KEDA or an HPA on
external metrics reads ``llm_gateway_pool_desired_replicas{pool=...}`` (see deploy/k8s).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily, Metric

from gateway.config import AutoscaleConfig
from gateway.fleet.endpoint import Endpoint

__all__ = ["AutoscaleCollector", "PoolSignal", "pool_signals"]


@dataclass(frozen=True, slots=True)
class PoolSignal:
    pool: str
    current: int
    desired: int
    kv_utilization: float  # mean over replicas (their ranks) with fresh metrics
    queue_depth: float  # sum of waiting requests over replicas with fresh metrics


def pool_signals(endpoints: Iterable[Endpoint], config: AutoscaleConfig) -> list[PoolSignal]:
    pools: dict[str, list[Endpoint]] = {}
    for endpoint in endpoints:
        if endpoint.healthy:
            pools.setdefault(endpoint.role.value, []).append(endpoint)
    signals = []
    for pool, members in sorted(pools.items()):
        pressure, kv_values, waiting_total = 0.0, [], 0.0
        for endpoint in members:
            ranks = endpoint.rank_targets or (endpoint,)
            replica_pressure = 0.0
            for rank in ranks:
                m = rank.metrics
                if not m.fresh():
                    replica_pressure += 1.0
                    continue
                kv = m.kv_usage if m.kv_usage is not None and math.isfinite(m.kv_usage) else 0.0
                waiting = m.waiting if m.waiting is not None and math.isfinite(m.waiting) else 0.0
                kv_values.append(kv)
                waiting_total += waiting
                replica_pressure += max(kv / config.kv_target, waiting / config.queue_target)
            pressure += replica_pressure / len(ranks)
        desired = max(1, math.ceil(pressure / (1.0 - config.headroom) - 1e-9))
        mean_kv = sum(kv_values) / len(kv_values) if kv_values else 0.0
        signals.append(PoolSignal(pool, len(members), desired, mean_kv, waiting_total))
    return signals


class AutoscaleCollector:
    """Exports the pool signals at scrape time (always current, no per-request cost).

    ``config`` is asked at each scrape: a reloaded ``autoscale`` section applies at once."""

    def __init__(
        self, endpoints: Callable[[], Iterable[Endpoint]], config: Callable[[], AutoscaleConfig]
    ) -> None:
        self._endpoints = endpoints
        self._config = config

    def collect(self) -> Iterator[Metric]:
        families = {
            "desired": GaugeMetricFamily(
                "llm_gateway_pool_desired_replicas",
                "Replicas the pool needs for its load at the target KV use and queue depth, with headroom",
                labels=["pool"],
            ),
            "current": GaugeMetricFamily(
                "llm_gateway_pool_current_replicas", "Healthy replicas in the pool", labels=["pool"]
            ),
            "kv": GaugeMetricFamily(
                "llm_gateway_pool_kv_utilization", "Mean KV-cache utilisation of the pool", labels=["pool"]
            ),
            "queue": GaugeMetricFamily(
                "llm_gateway_pool_queue_depth", "Waiting requests summed over the pool", labels=["pool"]
            ),
        }
        for signal in pool_signals(self._endpoints(), self._config()):
            families["desired"].add_metric([signal.pool], signal.desired)
            families["current"].add_metric([signal.pool], signal.current)
            families["kv"].add_metric([signal.pool], signal.kv_utilization)
            families["queue"].add_metric([signal.pool], signal.queue_depth)
        yield from families.values()
