"""One model-server replica as the gateway sees it: identity, role, health and live load."""

from __future__ import annotations

import ssl
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

if TYPE_CHECKING:
    from gateway.config.kv_events import KVEventSourceConfig
    from gateway.fleet.lora import LoraLoad
    from gateway.fleet.worker_table import LoadCell

__all__ = ["Endpoint", "EndpointMetrics", "EngineKind", "Role", "public_url"]


def public_url(url: str) -> str:
    """``url`` without its user info (``http://user:pw@host`` → ``http://host``).

    The only form of an endpoint URL that may be shown: in headers, metric labels, logs,
    error messages and admin answers. Credentials in the configured URL are sent as
    Basic auth and nowhere else.
    """
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


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
    lora: LoraLoad | None = None  # adapters in use (vllm:lora_requests_info); None: not reported
    scraped_at: float = 0.0  # monotonic time of the last successful scrape
    in_flight_at_scrape: int = 0  # the gateway's own in-flight count when that scrape landed
    in_flight_tokens_at_scrape: int = 0  # … and its in-flight prompt tokens
    pooled_at_scrape: int = 0  # of those requests, how many waited in the gateway's pool (not at the engine)
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
    auth_header: str | None = None  # "Bearer <token>" / "Basic …" sent upstream (configured per endpoint)
    # https: how the certificate is checked (None: system CAs, verified). Shared by the hot-path
    # client and the health/scrape session, so inference and probes trust the same servers.
    ssl_context: ssl.SSLContext | None = None
    max_num_seqs: int | None = None  # configured batch capacity (the engine does not export it)
    kv_events: KVEventSourceConfig | None = None  # its KV-event stream, configured (else discovered)
    # vLLM --data-parallel-size: N schedulers behind this URL, each a routing target (fleet/dp.py).
    data_parallel_size: int | None = None  # configured; else learned from the engine="<rank>" series
    dp_rank: int | None = None  # on a rank target: sent as X-data-parallel-rank
    replica: Endpoint | None = None  # on a rank target: its URL's endpoint (health, breaker, drain)
    rank_targets: tuple[Endpoint, ...] = ()  # on a data-parallel replica: its ranks (routed instead)
    # Runtime state.
    discovered_models: frozenset[str] = frozenset()
    adapters: dict[str, str] = field(default_factory=dict)  # LoRA adapter -> base model (/v1/models)
    adapters_in_flight: dict[str, int] = field(default_factory=dict)  # the gateway's, per adapter
    healthy: bool = False
    # Healthy on the word of a copy that left the fleet (membership: back with requests running),
    # not yet probed itself: its first failed probe takes it out, and its models are read again.
    inherited_health: bool = False
    ejected: bool = False  # circuit breaker open (or its half-open probe in flight)
    draining: bool = False  # admin drain: no new requests; in-flight ones finish
    # Batch capacity learned from the engine: the most requests it ran while others waited.
    learned_capacity: int = 0
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    metrics: EndpointMetrics = field(default_factory=EndpointMetrics)
    in_flight: int = 0
    in_flight_tokens: int = 0
    # Estimated uncached prompt tokens sent but not yet answered with a first chunk.
    pending_prefill_tokens: float = 0.0
    # With several workers: this worker's cells of the shared table (fleet/shared_load.py), where
    # the hooks write their changes too; the three fields above are then the whole gateway's.
    shared_load: LoadCell | None = None
    # Replaced in place (same URL, new settings: a reload): requests sent to this object end
    # there, so their counts moved to the successor and their releases follow them.
    replaced_by: Endpoint | None = None
    created_at: float = field(default_factory=time.monotonic)
    # Short label for metrics, headers and index keys: host:port[/prefix] (computed once; hot
    # path), never with user info in it.
    name: str = field(init=False, default="")
    # Where probes and scrapes go: the URL without user info (aiohttp would otherwise turn it
    # into an Authorization header of its own, clashing with ``auth_header``).
    base_url: str = field(init=False, default="")

    def __post_init__(self) -> None:
        self.base_url = public_url(self.url).rstrip("/")
        self.name = self.base_url.split("://", 1)[-1]
        if self.dp_rank is not None:
            self.name += f"#dp{self.dp_rank}"

    @property
    def owner(self) -> Endpoint:
        """The URL's endpoint: itself, or a rank target's replica (per-URL state lives there)."""
        return self.replica or self

    def latest(self) -> Endpoint:
        """This endpoint, or what replaced it in place: where its requests' counts now live."""
        endpoint = self
        while endpoint.replaced_by is not None:
            endpoint = endpoint.replaced_by
        return endpoint

    @property
    def models(self) -> frozenset[str]:
        return self.configured_models or self.discovered_models

    def serves(self, model: str) -> bool:
        return model in self.models

    def __repr__(self) -> str:
        return f"Endpoint({self.name}, role={self.role}, healthy={self.healthy})"
