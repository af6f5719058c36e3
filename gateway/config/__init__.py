"""Typed gateway configuration: YAML file, then ``LLM_GATEWAY_*`` environment, then CLI flags.

Validation happens here, at start-up, and every error names the offending key
(``endpoints.1.role``, ``profiles.0.plugins.2.ref``), so a bad deploy fails loudly
instead of routing wrongly. Plugin *types* are checked against the plugin registry
in :func:`gateway.scheduling.build.build_scheduler`, which is also run at start-up.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from gateway.config.base import ConfigError
from gateway.config.base import Strict as _Strict
from gateway.config.fleet import (
    DiscoveryConfig,
    DnsDiscoveryConfig,
    EndpointConfig,
    HealthConfig,
    KubernetesDiscoveryConfig,
    ScrapeConfig,
    check_endpoint_url,
)
from gateway.config.kv_events import ExactPrefixConfig, KVEventSourceConfig
from gateway.config.models import ModelsSection, WeightedTarget
from gateway.config.slo import SloConfig, SloTarget
from gateway.config.yaml_file import safe_load_bounded
from gateway.request.types import Priority

__all__ = [
    "AdmissionConfig",
    "AuthConfig",
    "AutoscaleConfig",
    "ConfigError",
    "DiscoveryConfig",
    "DnsDiscoveryConfig",
    "EndpointConfig",
    "ExactPrefixConfig",
    "GatewayConfig",
    "HealthConfig",
    "KVEventSourceConfig",
    "KubernetesDiscoveryConfig",
    "PluginSpec",
    "PrefixConfig",
    "ProfileSpec",
    "ResilienceConfig",
    "ScrapeConfig",
    "SessionConfig",
    "SloConfig",
    "SloTarget",
    "WeightedTarget",
    "check_endpoint_url",
    "format_validation_error",
    "load_config",
]

ENV_PREFIX = "LLM_GATEWAY_"


class ServerConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    workers: int = Field(1, ge=1, le=64, description="processes sharing the port via SO_REUSEPORT")
    worker_table_rows: int = Field(
        1024, ge=1, le=1 << 20, description="workers > 1: endpoints whose load the workers share"
    )
    worker_timeout_s: float = Field(
        30.0, ge=0, description="workers > 1: a worker whose loop has not run this long is killed (0: never)"
    )
    max_body_bytes: int = Field(16 * 1024 * 1024, gt=0)
    max_form_body_bytes: int = Field(
        26 * 1024 * 1024, gt=0, description="the audio routes' multipart bodies (OpenAI takes 25 MB files)"
    )
    shutdown_timeout_s: float = Field(30.0, ge=0)
    access_log: Literal["off", "json"] = Field("off", description="json: one JSON line per request")
    max_header_bytes: int = Field(8190, ge=256, description="longest request line or header field")
    max_headers: int = Field(64, ge=8, description="most request header fields")
    max_json_depth: int = Field(32, ge=2, description="deepest nesting accepted in a request body")
    max_json_containers: int = Field(100_000, ge=1, description="most arrays and objects in a request body")
    drain_s: float = Field(5.0, ge=0, description="on SIGTERM: report not-ready this long before closing")
    # Slow or silent clients (slowloris) must not hold sockets: every phase of reading a
    # request has a deadline. None of them limits a response, so long streams are unaffected.
    header_timeout_s: float = Field(
        10.0, gt=0, description="request headers complete within this, from accept or from their first byte"
    )
    body_timeout_s: float = Field(60.0, gt=0, description="the whole request body arrives within this")
    keepalive_timeout_s: float = Field(
        75.0, gt=0, description="close a connection idle between requests; above a load balancer's (60 s)"
    )
    max_connections: int = Field(
        0, ge=0, description="open client connections per worker; 0 = 3/4 of the file-descriptor limit"
    )

    @field_validator("worker_timeout_s")
    @classmethod
    def _worker_timeout_off_or_real(cls, value: float) -> float:
        if 0 < value < 1:  # the beat comes every quarter of it: a busy loop, and kills on any GC pause
            raise ValueError("must be 0 (off) or at least 1 second")
        return value


class TimeoutConfig(_Strict):
    connect_s: float = Field(2.0, gt=0)
    first_byte_s: float = Field(300.0, gt=0, description="until upstream response headers")
    idle_s: float = Field(60.0, gt=0, description="longest gap between streamed chunks")
    total_s: float = Field(900.0, gt=0)


class LimitConfig(_Strict):
    upstream_connections: int = Field(4096, ge=1, description="aiohttp connector limit, all endpoints")
    # Per worker. Above the largest batch an engine runs (vLLM's max_num_seqs: 1024 on >= 70 GiB GPUs, 256
    # below), so overload queues in the engine, which schedules by KV space; past the cap requests wait in
    # the pool (llm_gateway_endpoint_pool_waiting_requests, queued for the saturation detector).
    upstream_connections_per_endpoint: int = Field(
        2048, ge=0, description="pooled connections per endpoint, per worker; 0 = unlimited"
    )
    retries: int = Field(1, ge=0, le=5, description="re-sends before the first byte, never same endpoint")
    # held whole before it is sent on, so a hostile replica must not fill memory; 2,048 4k-dim embeddings fit
    max_response_bytes: int = Field(256 << 20, ge=1, description="largest non-streamed upstream answer")


class PrefixConfig(_Strict):
    backend: Literal["memory", "redis"] = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "llmgw"
    block_bytes: int = Field(64, ge=8, le=4096, description="prompt bytes per block (≈16 tokens)")
    capacity_blocks: int = Field(
        65536, ge=1, description="per-endpoint bound when the engine does not report its KV size"
    )
    ttl_s: float = Field(3600.0, gt=0)
    max_prompt_blocks: int = Field(
        16384, ge=1, description="blocks hashed per prompt at most (16384 × 64 B = 1 MB ≈ 256k tokens)"
    )
    redis_budget_s: float = Field(0.005, gt=0, description="longest a match may wait for Redis")
    redis_retry_after_s: float = Field(1.0, gt=0)
    exact: Literal["auto", "off"] = Field(
        "auto", description="auto: route on the engines' KV events where an endpoint publishes them"
    )
    kv_events: ExactPrefixConfig = Field(default_factory=ExactPrefixConfig)


class SessionConfig(_Strict):
    header: str = "x-session-id"
    body_fields: list[str] = Field(
        default_factory=lambda: ["user"], description="body fields tried in order after the header"
    )
    ttl_s: float = Field(1800.0, gt=0, description="refreshed on every use")
    backend: Literal["memory", "redis"] = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "llmgw"
    max_sessions: int = Field(1_000_000, ge=1, description="memory backend bound (LRU)")
    redis_budget_s: float = Field(0.005, gt=0)
    token_header: str | None = Field(
        "x-session-token", description="response/request header with a signed replica token; null = off"
    )
    token_secret: str | None = Field(None, description="shared by all instances; default: random per process")
    sources: list[str] | None = Field(
        None,
        description=(
            "session keys tried in order: 'header:<name>', 'body:<field>' (dotted: metadata.user_id), "
            "'previous_response_id' (a Responses chain is one session); null = `header`, the agent "
            "CLIs' headers, prompt_cache_key, `body_fields`, previous_response_id"
        ),
    )
    response_ttl_s: float = Field(
        86400.0, gt=0, description="how long the replica that stored a Responses API response is remembered"
    )
    max_responses: int = Field(1_000_000, ge=1, description="response id → replica entries (memory, LRU)")

    @model_validator(mode="after")
    def _check_sources(self) -> SessionConfig:
        for source in self.sources or ():
            kind, _, name = source.partition(":")
            if source != "previous_response_id" and (kind not in ("header", "body") or not name):
                raise ValueError(
                    f"sessions.sources: {source!r} is not 'header:<name>', 'body:<field>' "
                    "or 'previous_response_id'"
                )
        return self


class DegradeConfig(_Strict):
    sheddable_max_tokens: int | None = Field(
        None, ge=1, description="under pressure, clamp sheddable requests' max_tokens to this"
    )
    fallback_model: str | None = Field(
        None, description="when a sheddable request's pool is saturated, serve it with this model"
    )


class AdmissionConfig(_Strict):
    enabled: bool = True
    priority_header: str = "x-priority"
    tenant_header: str = "x-tenant-id"
    queue_depth_threshold: float = Field(5, gt=0, description="waiting requests that saturate a replica")
    kv_utilization_threshold: float = Field(0.8, gt=0, le=1)
    queue_timeout_s: float = Field(10.0, gt=0)
    max_queue: int = Field(1024, ge=0)
    critical_max_concurrency: int = Field(256, ge=1)
    max_concurrency: int = Field(0, ge=0, description="global in-flight cap; 0 = none")
    endpoint_max_concurrency: int = Field(0, ge=0, description="per-endpoint in-flight cap; 0 = none")
    burst_scrape_requests: int = Field(
        4,
        ge=0,
        description="scrape a replica at once when the gateway's in-flight requests to it grew by this"
        " many since its last scrape and its batch capacity is not known yet (a burst from idle);"
        " 0 = only on the interval",
    )
    burst_settle_s: float = Field(
        0.25, ge=0, description="a sheddable request waits at most this long for such a scrape's answer"
    )
    retry_after_s: float = Field(1.0, gt=0)
    degrade: DegradeConfig = Field(default_factory=DegradeConfig)
    slo: SloConfig = Field(default_factory=SloConfig)
    engine_priority: dict[Priority, int] | None = Field(
        None,
        description="send each class's value as the body's `priority` (vLLM/SGLang priority scheduling;"
        " engines must run with --scheduling-policy priority). Lower is served first in vLLM.",
    )


class PDConfig(_Strict):
    """Prefill/decode disaggregation; active when endpoints with role ``prefill`` exist."""

    protocol: Literal["vllm", "sglang"] = "vllm"
    decider: Literal["always", "never", "prefix-aware"] = "prefix-aware"
    threshold_tokens: int = Field(512, ge=0, description="prefix-aware: disaggregate above this uncached")
    prefill_timeout_s: float = Field(120.0, gt=0)
    fallback_to_decode: bool = Field(True, description="prefill failed everywhere → decode-only, counted")


class AutoscaleConfig(_Strict):
    kv_target: float = Field(0.7, gt=0, le=1, description="KV utilisation a replica should run at")
    queue_target: float = Field(2.0, gt=0, description="waiting requests a replica may carry")
    headroom: float = Field(0.1, ge=0, lt=1, description="spare capacity kept warm")


class ResilienceConfig(_Strict):
    """Circuit breaker / outlier ejection per endpoint, and the fleet-wide retry budget."""

    consecutive_failures: int = Field(3, ge=1, description="eject after this many failures in a row")
    error_rate: float = Field(0.5, gt=0, le=1, description="… or this failure ratio in the window")
    window_s: float = Field(10.0, gt=0)
    min_requests: int = Field(10, ge=1, description="requests in the window before the rate counts")
    ejection_s: float = Field(1.0, gt=0, description="first ejection; doubles per repeat")
    max_ejection_s: float = Field(30.0, gt=0)
    max_ejected_fraction: float = Field(
        0.5, gt=0, le=1, description="never eject more than this share of a model's endpoints"
    )
    retry_budget_ratio: float = Field(0.2, ge=0, le=1, description="retries ≤ this share of requests")
    retry_budget_min_per_s: float = Field(5.0, ge=0, description="retries always allowed at this rate")
    retry_backoff_s: float = Field(0.01, ge=0, description="base back-off before a retry (full jitter)")
    stall_s: float = Field(
        1.5,
        gt=0,
        description="requests waiting this long for a first byte that the engine's fresh"
        " metrics do not count mark the endpoint stalled",
    )
    check_interval_s: float = Field(0.25, gt=0, description="how often ejections and stalls are reviewed")


class AuthConfig(_Strict):
    """API keys → tenants. Off by default (the demo); the Helm chart turns it on."""

    enabled: bool = False
    backend: Literal["file", "redis"] = "file"
    keys_file: str | None = Field(None, description="YAML: tenants and sha256 key hashes")
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "llmgw"
    limits_backend: Literal["memory", "redis"] = Field(
        "memory", description="redis: token buckets shared by every gateway instance"
    )
    redis_budget_s: float = Field(0.02, gt=0, description="longest a limit check may wait for Redis")
    admin_key_sha256: str | None = Field(None, description="enables /admin/*; hex sha256 of the admin key")

    @field_validator("admin_key_sha256")
    @classmethod
    def _admin_digest(cls, value: str | None) -> str | None:
        """A raw key or a digest with a trailing newline loaded and then refused every admin call."""
        if value is None:
            return None
        value = value.strip().lower()
        if not re.fullmatch(r"[0-9a-f]{64}", value):  # never echo it: it may be the key itself
            raise ValueError("must be the hex sha256 of the admin key (64 hex digits), not the key itself")
        return value

    @model_validator(mode="after")
    def _source(self) -> AuthConfig:
        if self.enabled and self.backend == "file" and not self.keys_file:
            raise ValueError("keys_file: required when auth is enabled with the file backend")
        return self


class PluginSpec(_Strict):
    type: str
    name: str | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)

    @property
    def instance_name(self) -> str:
        return self.name or self.type


class ProfilePluginRef(_Strict):
    ref: str
    weight: float = Field(1.0, ge=0)


class ProfileSpec(_Strict):
    name: str
    plugins: list[ProfilePluginRef]


class GatewayConfig(_Strict):
    server: ServerConfig = Field(default_factory=ServerConfig)
    endpoints: list[EndpointConfig] = Field(default_factory=list)
    health: HealthConfig = Field(default_factory=HealthConfig)
    scrape: ScrapeConfig = Field(default_factory=ScrapeConfig)
    timeouts: TimeoutConfig = Field(default_factory=TimeoutConfig)
    limits: LimitConfig = Field(default_factory=LimitConfig)
    prefix: PrefixConfig = Field(default_factory=PrefixConfig)
    sessions: SessionConfig = Field(default_factory=SessionConfig)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    pd: PDConfig = Field(default_factory=PDConfig)
    autoscale: AutoscaleConfig = Field(default_factory=AutoscaleConfig)
    discovery: DiscoveryConfig = Field(default_factory=DiscoveryConfig)
    resilience: ResilienceConfig = Field(default_factory=ResilienceConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    models: ModelsSection = Field(
        default_factory=dict, description="model aliases and weighted splits (gateway.config.models)"
    )
    policy: str | None = Field(None, description="a named preset; exclusive with plugins/profiles")
    plugins: list[PluginSpec] = Field(default_factory=list)
    profiles: list[ProfileSpec] = Field(default_factory=list)
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @model_validator(mode="after")
    def _check_references(self) -> GatewayConfig:
        if self.policy and (self.plugins or self.profiles):
            raise ValueError("policy: give either a preset name or plugins/profiles, not both")
        names: set[str] = set()
        for index, spec in enumerate(self.plugins):
            if spec.instance_name in names:
                raise ValueError(f"plugins.{index}.name: duplicate plugin name {spec.instance_name!r}")
            names.add(spec.instance_name)
        if self.plugins and not self.profiles:
            raise ValueError("profiles: plugins are configured but no profile references them")
        for p_index, profile in enumerate(self.profiles):
            for r_index, ref in enumerate(profile.plugins):
                if ref.ref not in names:
                    raise ValueError(
                        f"profiles.{p_index}.plugins.{r_index}.ref: unknown plugin {ref.ref!r}"
                        f" (defined: {sorted(names)})"
                    )
        roles = {e.role for e in self.endpoints}
        if "prefill" in roles and not roles & {"decode", "both"}:
            raise ValueError("endpoints: prefill endpoints need at least one decode (or both) endpoint")
        if self.pd.protocol == "sglang":
            for index, endpoint in enumerate(self.endpoints):
                if endpoint.role == "prefill" and endpoint.bootstrap_port is None:
                    raise ValueError(
                        f"endpoints.{index}.bootstrap_port: required for SGLang prefill endpoints"
                    )
        urls = [e.url for e in self.endpoints]
        for index, url in enumerate(urls):
            if url in urls[:index]:
                raise ValueError(f"endpoints.{index}.url: duplicate endpoint {url!r}")
        return self


def format_validation_error(error: ValidationError) -> str:
    """``endpoints.1.role: Input should be …; …`` — key paths and messages, never the offending input."""
    lines = []
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        lines.append(f"{key}: {message}" if key else message)
    return "; ".join(lines)


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(path)}: cannot set a key below non-mapping {part!r}")
        node = child
    node[path[-1]] = value


def _env_overrides(environ: dict[str, str]) -> dict[str, Any]:
    """``LLM_GATEWAY_SERVER__PORT=9000`` → ``{"server": {"port": 9000}}``; values are YAML scalars.

    Shortcuts: ``LLM_GATEWAY_PORT``, ``LLM_GATEWAY_HOST``, ``LLM_GATEWAY_POLICY``,
    ``LLM_GATEWAY_ENDPOINTS`` (comma-separated URLs).
    """
    shortcuts = {"PORT": ["server", "port"], "HOST": ["server", "host"], "POLICY": ["policy"]}
    tree: dict[str, Any] = {}
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX):
            continue
        suffix = key[len(ENV_PREFIX) :]
        if suffix == "ENDPOINTS":
            tree["endpoints"] = [{"url": u.strip()} for u in raw.split(",") if u.strip()]
            continue
        path = shortcuts.get(suffix) or [part.lower() for part in suffix.split("__")]
        _set_path(tree, path, safe_load_bounded(raw) if raw else raw)
    return tree


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_config(
    path: str | Path | None = None,
    *,
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> GatewayConfig:
    """Build the config: file < environment < ``overrides`` (the CLI flags)."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = safe_load_bounded(Path(path).read_text())
        except (OSError, ValueError, yaml.YAMLError, RecursionError) as exc:  # not UTF-8; nested too deep
            raise ConfigError(f"cannot read config file {path}: {exc}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
        raw = loaded
    raw = _merge(raw, _env_overrides(dict(os.environ if environ is None else environ)))
    raw = _merge(raw, overrides or {})
    try:
        return GatewayConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError("invalid configuration: " + format_validation_error(exc)) from None
