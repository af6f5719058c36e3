"""HTTP handlers: thin. Parse → check the model → schedule → proxy; operations endpoints."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.access_log import INFERENCE_REQUEST
from gateway.errors import ModelNotFound, NoHealthyEndpoint
from gateway.middleware import REQUEST_ID
from gateway.parsing import parse_request
from gateway.state import STATE, GatewayState
from gateway.types import ApiKind, Endpoint

__all__ = ["add_routes"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _inference_handler(api: ApiKind) -> Handler:
    async def handle(http_request: web.Request) -> web.StreamResponse:
        state = http_request.app[STATE]
        request = parse_request(
            api,
            await http_request.read(),
            request_id=http_request[REQUEST_ID],
            headers=http_request.headers,
            options=state.parse_options,
        )
        http_request[INFERENCE_REQUEST] = request
        _candidates(state, request.model)  # 404 / 503 before the request takes a queue slot
        ticket = await state.admission.admit(request)
        try:
            candidates = _candidates(state, request.model)  # the model may have been degraded
            result = await state.scheduler.schedule(request, candidates)
            if state.access_log.enabled:
                best = result.ranked[0]
                request.attributes["route"] = {
                    "profile": result.primary_profile,
                    "score": round(best.score, 4),
                }
            extra = {"x-request-id": request.request_id}
            if ticket.degraded:
                extra["x-gateway-degraded"] = ticket.degraded
            if request.debug:
                extra["x-gateway-scores"] = result.explain()
            assert state.proxy is not None
            return await state.proxy.forward(http_request, request, result, extra)
        finally:
            state.admission.release(ticket)

    return handle


def _candidates(state: GatewayState, model: str) -> list[Endpoint]:
    candidates = state.registry.candidates(model)
    if not candidates:
        if not state.registry.is_known_model(model):
            raise ModelNotFound(f"The model {model!r} does not exist", param="model")
        raise NoHealthyEndpoint(f"no healthy endpoint serves model {model!r}")
    return candidates


async def list_models(http_request: web.Request) -> web.Response:
    registry = http_request.app[STATE].registry
    data = [
        {"id": model, "object": "model", "created": 0, "owned_by": "llm-gateway"}
        for model in registry.healthy_models()
    ]
    return web.json_response({"object": "list", "data": data})


async def health(http_request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(http_request: web.Request) -> web.Response:
    registry = http_request.app[STATE].registry
    healthy = sum(1 for e in registry if e.healthy)
    status = 200 if healthy else 503
    return web.json_response({"ready": healthy > 0, "healthy_endpoints": healthy}, status=status)


async def metrics(http_request: web.Request) -> web.Response:
    registry = http_request.app[STATE].metrics.registry
    body = generate_latest(registry)
    return web.Response(body=body, headers={"content-type": CONTENT_TYPE_LATEST})


async def endpoints_status(http_request: web.Request) -> web.Response:
    """Read-only view of what the gateway believes about each endpoint (debugging aid)."""
    now = time.monotonic()
    rows = [
        {
            "url": e.url,
            "role": e.role.value,
            "engine": e.engine.value,
            "models": sorted(e.models),
            "healthy": e.healthy,
            "in_flight": e.in_flight,
            "in_flight_tokens": e.in_flight_tokens,
            "waiting": e.metrics.waiting,
            "running": e.metrics.running,
            "kv_usage": e.metrics.kv_usage,
            "metrics_stale": e.metrics.stale,
            "metrics_age_s": round(now - e.metrics.scraped_at, 3) if e.metrics.scraped_at else None,
        }
        for e in http_request.app[STATE].registry
    ]
    return web.json_response({"endpoints": rows})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", _inference_handler(ApiKind.CHAT))
    app.router.add_post("/v1/completions", _inference_handler(ApiKind.COMPLETIONS))
    app.router.add_post("/v1/embeddings", _inference_handler(ApiKind.EMBEDDINGS))
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/debug/endpoints", endpoints_status)
