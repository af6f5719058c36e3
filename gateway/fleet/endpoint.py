"""One model-server replica as the gateway sees it: identity, role, health and live load."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum

__all__ = ["Endpoint", "EndpointMetrics", "EngineKind", "Role"]


class Role(StrEnum):
    BOTH = "both"
    PREFILL = "prefill"
    DECODE = "decode"


class EngineKind(StrEnum):
    VLLM = "vllm"
    SGLANG = "sglang"


@dataclass(slots=True)
class EndpointMetrics:
    """Load read from the engine's own /metrics. ``None`` means "not reported"."""

    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None
    block_size: int | None = None
    num_blocks: int | None = None
    scraped_at: float = 0.0  # monotonic time of the last successful scrape
    in_flight_at_scrape: int = 0  # the gateway's own in-flight count when that scrape landed
    stale: bool = True

    def fresh(self) -> bool:
        return not self.stale and self.scraped_at > 0


@dataclass(eq=False, slots=True)
class Endpoint:
    """One model-server replica and everything the gateway knows about it right now.

    Identity is the object itself (``eq=False``): scorers key their results by it.
    The in-flight counters are the gateway's own, updated instantly, because the
    scraped metrics lag by a scrape interval.
    """

    url: str
    role: Role = Role.BOTH
    engine: EngineKind = EngineKind.VLLM
    configured_models: frozenset[str] = frozenset()
    labels: dict[str, str] = field(default_factory=dict)
    bootstrap_port: int | None = None
    auth_header: str | None = None  # "Bearer <token>" sent upstream (configured per endpoint)
    # Runtime state.
    discovered_models: frozenset[str] = frozenset()
    healthy: bool = False
    ejected: bool = False  # circuit breaker open (or its half-open probe in flight)
    draining: bool = False  # admin drain: no new requests; in-flight ones finish
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    metrics: EndpointMetrics = field(default_factory=EndpointMetrics)
    in_flight: int = 0
    in_flight_tokens: int = 0
    # Estimated uncached prompt tokens sent but not yet answered with a first chunk.
    pending_prefill_tokens: float = 0.0
    created_at: float = field(default_factory=time.monotonic)
    # Short label for metrics, headers and index keys: host:port (computed once; hot path).
    name: str = field(init=False, default="")

    def __post_init__(self) -> None:
        self.name = self.url.split("://", 1)[-1].rstrip("/")

    @property
    def models(self) -> frozenset[str]:
        return self.configured_models or self.discovered_models

    def serves(self, model: str) -> bool:
        return model in self.models

    def __repr__(self) -> str:
        return f"Endpoint({self.name}, role={self.role}, healthy={self.healthy})"
