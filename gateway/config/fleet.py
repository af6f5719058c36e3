"""Config sections about where endpoints come from: the endpoints themselves, their health
checks and metric scrapes, and discovery (Kubernetes, DNS) with its network bounds."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

import pydantic
from pydantic import Field, field_validator, model_validator

from gateway.config.base import Strict as _Strict
from gateway.config.kv_events import KVEventSourceConfig

__all__ = [
    "DiscoveryConfig",
    "DnsDiscoveryConfig",
    "EndpointConfig",
    "HealthConfig",
    "KubernetesDiscoveryConfig",
    "ScrapeConfig",
    "check_api_key",
    "check_endpoint_url",
]


def check_endpoint_url(value: str) -> str:
    """Strict, because the URL becomes a request line, a ``Host`` header and a socket address:
    no spaces or control characters (a split request), a host, a port in 1..65535 (else the
    first request fails far from its cause). A path is a prefix; user info is Basic auth."""
    if any(ord(c) <= 0x20 or ord(c) >= 0x7F for c in value):
        raise ValueError("must not contain spaces, control or non-ASCII characters")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname or "?" in value or "#" in value:
        raise ValueError("must be an http:// or https:// URL with a host and no query or fragment")
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0 or parts.netloc.endswith(":"):
        raise ValueError("port must be a number from 1 to 65535")
    return value.rstrip("/")


def check_api_key(value: str) -> str:
    """A bearer token goes into a header line: printable ASCII only. A line end in it made
    every request to the replica fail inside the HTTP client (its health probes too, so it
    stayed unhealthy for ever, with nothing above a debug log to say why)."""
    if any(ord(c) < 0x21 or ord(c) >= 0x7F for c in value):
        raise ValueError("must be printable ASCII, without spaces or control characters")
    return value


class EndpointConfig(_Strict):
    url: str
    models: list[str] = Field(default_factory=list, description="empty: discovered from /v1/models")
    role: Literal["both", "prefill", "decode"] = "both"
    engine: Literal["vllm", "sglang"] = "vllm"
    labels: dict[str, str] = Field(default_factory=dict)
    bootstrap_port: int | None = Field(None, ge=1, le=65535)
    api_key: str | None = Field(None, description="sent upstream as a bearer token; never logged")
    api_key_file: str | None = Field(None, description="file holding that token (a mounted Secret)")
    max_num_seqs: int | None = Field(
        None, ge=1, description="the engine's batch capacity, if known (else learned when it first queues)"
    )
    tls_ca_file: str | None = Field(None, description="https: PEM CA bundle; default: the system's CAs")
    tls_verify: bool = Field(True, description="https: verify the certificate and host name")
    data_parallel_size: int | None = Field(
        None, ge=1, le=1024, description="vLLM --data-parallel-size; none: learned from its engine label"
    )
    kv_events: KVEventSourceConfig | None = Field(
        None, description="its KV-event stream, instead of what its GET /kv_event_sources says"
    )

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        return check_endpoint_url(value)

    @field_validator("api_key")
    @classmethod
    def _header_safe_key(cls, value: str | None) -> str | None:
        return None if value is None else check_api_key(value)


class HealthConfig(_Strict):
    interval_s: float = Field(2.0, gt=0)
    timeout_s: float = Field(1.0, gt=0)
    healthy_threshold: int = Field(1, ge=1)
    unhealthy_threshold: int = Field(2, ge=1)
    path: str = "/health"
    models_refresh_s: float = Field(
        15.0, gt=0, description="re-read discovered /v1/models this often (LoRA adapters loaded at run time)"
    )


class ScrapeConfig(_Strict):
    interval_s: float = Field(1.0, gt=0)
    timeout_s: float = Field(1.0, gt=0, description="a busy engine's /metrics can take over 0.5 s")
    stale_after_s: float = Field(3.0, gt=0)
    enabled: bool = True
    burst_min_interval_s: float = Field(
        0.02, ge=0, description="at most one burst-triggered scrape of a replica this often (admission)"
    )


class KubernetesDiscoveryConfig(_Strict):
    """Endpoints from the pods matching a label selector (list + watch on the API server)."""

    namespace: str = "default"
    label_selector: str = Field("", description="e.g. app=vllm,llm-d.ai/inference-serving=true")
    port: int | None = Field(None, ge=1, le=65535, description="fallback when the pod has no port annotation")
    port_annotation: str = "llm-gateway.io/port"
    scheme: Literal["http", "https"] = "http"
    role_labels: list[str] = Field(
        default_factory=lambda: ["llm-gateway.io/role", "llm-d.ai/role"],
        description="first label present wins; values both|prefill|decode (llm-d: prefill|decode|both)",
    )
    engine_label: str = "llm-gateway.io/engine"
    model_label: str = "llm-gateway.io/model"
    api_server: str | None = Field(None, description="default: in-cluster (KUBERNETES_SERVICE_HOST)")
    token_file: str = "/var/run/secrets/kubernetes.io/serviceaccount/token"
    ca_file: str | None = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
    resync_s: float = Field(300.0, gt=0, description="re-list this often even if the watch is quiet")


class DnsDiscoveryConfig(_Strict):
    """Endpoints from a DNS name, re-resolved every ``interval_s`` (A/AAAA with a port, or SRV)."""

    name: str
    record: Literal["A", "AAAA", "A+AAAA", "SRV"] = "A+AAAA"
    port: int | None = Field(None, ge=1, le=65535, description="required for A/AAAA")
    scheme: Literal["http", "https"] = "http"
    interval_s: float = Field(10.0, gt=0)
    nameserver: str | None = Field(None, description="host:port; default: the system resolver")
    role: Literal["both", "prefill", "decode"] = "both"
    engine: Literal["vllm", "sglang"] = "vllm"
    models: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _port_for_address_records(self) -> DnsDiscoveryConfig:
        if self.record != "SRV" and self.port is None:
            raise ValueError(f"port: required for {self.record} records (SRV records carry their own)")
        return self


class DiscoveryConfig(_Strict):
    kubernetes: KubernetesDiscoveryConfig | None = None
    dns: list[DnsDiscoveryConfig] = Field(default_factory=list)
    allowed_networks: list[pydantic.IPvAnyNetwork] = Field(
        default_factory=list, description="CIDRs run-time endpoints (discovery, admin API) must lie in"
    )
    allow_link_local: bool = Field(
        False, description="accept 169.254.0.0/16, fe80::/10 (metadata) at run time"
    )
