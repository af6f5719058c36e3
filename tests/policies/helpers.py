"""Real ``Endpoint`` / ``InferenceRequest`` objects, and plugins built the way the gateway builds them."""

from __future__ import annotations

import json
import time
from typing import Any

from gateway.config import load_config
from gateway.fleet.endpoint import Endpoint, EngineKind, Role
from gateway.http.app import build_app
from gateway.http.plugins import default_registry
from gateway.http.state import STATE
from gateway.request.parse import parse_request
from gateway.request.types import ApiKind, InferenceRequest
from gateway.scheduling.framework import PluginKind
from gateway.scheduling.result import ScoredEndpoint

__all__ = ["endpoint", "make_plugin", "request", "scored", "with_metrics"]


def endpoint(
    n: int,
    *,
    healthy: bool = True,
    models: tuple[str, ...] = ("m",),
    role: Role = Role.BOTH,
    in_flight: int = 0,
    in_flight_tokens: int = 0,
) -> Endpoint:
    e = Endpoint(
        url=f"http://10.0.0.{n}:8000",
        role=role,
        engine=EngineKind.VLLM,
        configured_models=frozenset(models),
    )
    e.healthy = healthy
    e.in_flight = in_flight
    e.in_flight_tokens = in_flight_tokens
    return e


def with_metrics(
    e: Endpoint,
    *,
    waiting: float | None = None,
    running: float | None = None,
    kv: float | None = None,
    stale: bool = False,
) -> Endpoint:
    """Give ``e`` scraped load, fresh (just scraped) unless ``stale``."""
    m = e.metrics
    m.waiting, m.running, m.kv_usage = waiting, running, kv
    m.scraped_at = time.monotonic()
    m.stale = stale
    return e


def request(model: str = "m", text: str = "hello there", **headers: str) -> InferenceRequest:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": text}]}).encode()
    return parse_request(ApiKind.CHAT, body, request_id="req-1", headers=headers)


def scored(*pairs: tuple[Endpoint, float]) -> list[ScoredEndpoint]:
    return [ScoredEndpoint(e, s, {"s": s}) for e, s in pairs]


def make_plugin(type_name: str, parameters: dict[str, Any] | None = None) -> Any:
    """Build one plugin instance through config → ``build_app`` → scheduler, as in production."""
    kind = default_registry(load_entry_points=False).get(type_name).kind
    plugins = [{"type": type_name, "name": "under-test", "parameters": parameters or {}}]
    refs = [] if kind is PluginKind.PROFILE_HANDLER else [{"ref": "under-test"}]
    config = load_config(
        overrides={"plugins": plugins, "profiles": [{"name": "p", "plugins": refs}]}, environ={}
    )
    scheduler = build_app(config)[STATE].routing.scheduler
    profile = scheduler.profiles["p"]
    if kind is PluginKind.FILTER:
        return profile.filters[0]
    if kind is PluginKind.SCORER:
        return profile.scorers[0].scorer
    if kind is PluginKind.PICKER:
        return profile.picker
    return scheduler.handler
