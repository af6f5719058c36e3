"""HTTP handlers: thin. Parse → check the model → schedule → proxy; operations endpoints."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.errors import EndpointUnavailable, GatewayError, ModelNotFound, NoHealthyEndpoint, quoted
from gateway.fleet.endpoint import Endpoint
from gateway.http.access_log import INFERENCE_REQUEST
from gateway.http.admin import endpoint_row, require_admin_key
from gateway.http.middleware import REQUEST_ID, InFlight
from gateway.http.openapi import serve_openapi
from gateway.http.responses import (
    add_response_routes,
    check_continues,
    replica_did_not_answer,
    stored_replica,
)
from gateway.http.state import STATE, GatewayState
from gateway.request.multipart import parse_form
from gateway.request.parse import parse_request
from gateway.request.slo import parse_slo
from gateway.request.types import FORM_APIS, ApiKind, InferenceRequest, RouteTrace

__all__ = ["add_routes"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# APIs whose ``model`` may be left out, as the engines allow: the fleet's only model then.
_MODEL_OPTIONAL = frozenset({ApiKind.TOKENIZE, ApiKind.DETOKENIZE})


def _inference_handler(api: ApiKind, path: str | None = None) -> Handler:
    async def handle(http_request: web.Request) -> web.StreamResponse:
        state = http_request.app[STATE]
        auth = state.auth
        tenant = await auth.authenticate(http_request.headers) if auth is not None else None
        default_model = None
        if api in _MODEL_OPTIONAL and len(models := state.registry.healthy_models()) == 1:
            default_model = models[0]
        body = http_request
        if api in FORM_APIS:  # an audio file may be larger than a JSON body is allowed to be
            body = http_request.clone(client_max_size=state.config.server.max_form_body_bytes)
        raw = await body.read()
        arrived = time.monotonic()  # the objectives' deadlines run from here
        form = parse_form(raw, http_request.headers.get("content-type", "")) if api in FORM_APIS else None
        request = parse_request(
            api,
            raw,
            request_id=http_request[REQUEST_ID],
            headers=http_request.headers,
            options=state.parse_options,
            default_model=default_model,
            path=path,
            form=form,
        )
        http_request[INFERENCE_REQUEST] = request
        limit_headers: dict[str, str] = {}
        rate_headers: dict[str, str] = {}
        charged = 0
        if tenant is not None:
            auth.authorize(tenant, request, state.parse_options.priority_header in http_request.headers)
            # The tenant may bring objectives of its own, and its priority picks the class defaults.
            slo_options = state.parse_options.slo
            request.slo = parse_slo(
                http_request.headers, request.priority, slo_options, arrived, tenant.slo_objectives
            )
            decision, charged = await auth.limit(tenant, request)
            rate_headers = decision.headers()
            limit_headers = dict(rate_headers)
        failed, abandoned = True, False
        try:  # from here every way out settles the charge (a chain's 404/409 too: refunded)
            aliases = state.aliases
            stored: Endpoint | None = None
            if aliases and aliases.is_alias(request.model):  # a chain keeps its replica's target
                stored = await stored_replica(state, request)
            serves = stored.serves if stored is not None else None
            if aliases and (target := aliases.resolve(request, serves)) is not None:
                limit_headers["x-gateway-model"] = target  # keys allow the alias; the engine sees its target
            response = await _route(state, http_request, request, limit_headers, stored)
            failed = response.status >= 400
            return response
        except GatewayError as exc:  # every answer carries the tenant's x-ratelimit-* headers
            exc.extra_headers.update(rate_headers)
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            # The client left: what a replica did for it is not refunded. Not the gateway's own
            # cut (shutdown, a stuck request): the client is answered 503 and may retry.
            abandoned = InFlight.reason(http_request) is None
            raise
        finally:
            if tenant is not None:
                auth.settle_later(tenant, charged, request, failed, abandoned)

    return handle


async def _route(
    state: GatewayState,
    http_request: web.Request,
    request: InferenceRequest,
    extra: dict[str, str],
    stored: Endpoint | None = None,
) -> web.StreamResponse:
    """Admission, scheduling and the proxy, for a request that passed authentication and limits."""
    if stored is None:
        stored = await stored_replica(state, request)  # Responses: the replica holding the chain
    if stored is None:
        _candidates(state, request.model)  # 404 / 503 before the request takes a queue slot
    else:  # a chain's replica may be draining (it still holds its responses), the only one of the model
        check_continues(stored, request)
    shared = state.shared_load  # workers > 1: the siblings' load, for admission and for routing
    if shared is not None:
        shared.refresh()
    ticket = await state.admission.admit(request, pinned=stored is not None)
    try:
        if shared is not None:
            # Always, not throttled: a sibling's request that ended a moment ago (its client
            # already sending the next turn here) must not count against its replica.
            shared.refresh(force=True)
        if stored is not None:
            candidates = [stored]
        else:  # a replica at endpoint_max_concurrency takes no more while another has room
            every = _candidates(state, request.model)
            candidates = state.admission.with_room(every)
            if len(candidates) < len(every):
                request.context.at_cap = frozenset(e.name for e in every) - {e.name for e in candidates}
        routing = state.routing  # read once: a reload mid-request must not mix two policies
        result = await routing.scheduler.schedule(request, candidates)
        state.admission.sent(ticket)  # counted on its replica before this task next yields
        if state.access_log.enabled:
            request.context.route = RouteTrace(result.primary_profile, round(result.ranked[0].score, 4))
        extra = {"x-request-id": request.request_id, **extra}
        if ticket.degraded:
            extra["x-gateway-degraded"] = ticket.degraded
        if request.debug:
            extra["x-gateway-scores"] = result.explain()
        assert state.proxy is not None
        try:
            return await state.proxy.forward(http_request, request, result, extra, routing.hooks)
        except EndpointUnavailable:
            if stored is None:
                raise
            raise replica_did_not_answer(request.body["previous_response_id"], stored) from None
    finally:
        state.admission.release(ticket)


def _candidates(state: GatewayState, model: str) -> list[Endpoint]:
    candidates = state.registry.candidates(model)
    if not candidates:
        if not state.registry.is_known_model(model):
            raise ModelNotFound(f"The model {quoted(model)} does not exist", param="model")
        raise NoHealthyEndpoint(f"no healthy endpoint serves model {quoted(model)}")
    return candidates


async def list_models(http_request: web.Request) -> web.Response:
    """Models with a healthy endpoint, and aliases with a target among them; with auth on,
    only those the caller's key may use."""
    state = http_request.app[STATE]
    models = state.registry.healthy_models()
    if state.aliases:
        models = [*models, *(a for a in state.aliases.listed(models) if a not in models)]
    if state.auth is not None:
        tenant = await state.auth.authenticate(http_request.headers)
        models = [m for m in models if tenant.allows_model(m)]
    data = [{"id": model, "object": "model", "created": 0, "owned_by": "llm-gateway"} for model in models]
    # LoRA adapters, as the replicas that may be routed to say (one out of rotation may be stale)
    routable = (e for e in state.registry if e.healthy and not e.ejected and not e.draining)
    parents = {a: p for e in routable for a, p in e.adapters.items()}
    for entry in data:
        if (parent := parents.get(entry["id"])) is not None:
            entry["parent"] = parent
    return web.json_response({"object": "list", "data": data})


async def health(http_request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(http_request: web.Request) -> web.Response:
    """503 with no healthy endpoint, and while shutting down (so load balancers stop sending)."""
    state = http_request.app[STATE]
    healthy = sum(1 for e in state.registry if e.healthy)
    is_ready = healthy > 0 and not state.shutting_down
    body = {"ready": is_ready, "healthy_endpoints": healthy, "shutting_down": state.shutting_down}
    return web.json_response(body, status=200 if is_ready else 503)


async def metrics(http_request: web.Request) -> web.Response:
    state = http_request.app[STATE]
    if state.shared_load is not None:  # the whole gateway's in-flight numbers, as of now
        state.shared_load.refresh(force=True)
    if state.metrics_share is not None:  # workers > 1: every worker's series, labelled by worker
        body = await state.metrics_share.exposition()
    else:
        body = generate_latest(state.metrics.registry)
    return web.Response(body=body, headers={"content-type": CONTENT_TYPE_LATEST})


async def endpoints_status(http_request: web.Request) -> web.Response:
    """Read-only view of what the gateway believes about each endpoint (debugging aid)."""
    state = http_request.app[STATE]
    if state.auth is not None:  # with auth on, fleet internals are for the admin key only
        require_admin_key(state, http_request)
    if state.shared_load is not None:
        state.shared_load.refresh(force=True)
    now = time.monotonic()
    return web.json_response({"endpoints": [endpoint_row(state, e, now) for e in state.registry]})


# The rest of the engines' inference surface: route → API (the path is passed on as it is).
_ENGINE_ROUTES = {
    "/v1/responses": ApiKind.RESPONSES,
    "/v1/messages": ApiKind.MESSAGES,
    "/v1/messages/count_tokens": ApiKind.COUNT_TOKENS,
    "/v1/rerank": ApiKind.RERANK,
    "/rerank": ApiKind.RERANK,
    "/v2/rerank": ApiKind.RERANK,
    "/v1/score": ApiKind.SCORE,
    "/score": ApiKind.SCORE,
    "/classify": ApiKind.CLASSIFY,
    "/pooling": ApiKind.POOLING,
    "/tokenize": ApiKind.TOKENIZE,
    "/detokenize": ApiKind.DETOKENIZE,
    "/v1/audio/transcriptions": ApiKind.TRANSCRIPTIONS,  # multipart/form-data
    "/v1/audio/translations": ApiKind.TRANSLATIONS,
}


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", _inference_handler(ApiKind.CHAT))
    app.router.add_post("/v1/completions", _inference_handler(ApiKind.COMPLETIONS))
    app.router.add_post("/v1/embeddings", _inference_handler(ApiKind.EMBEDDINGS))
    for route_path, api in _ENGINE_ROUTES.items():
        upstream = route_path if route_path != api.upstream_path else None
        app.router.add_post(route_path, _inference_handler(api, upstream))
    add_response_routes(app)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/debug/endpoints", endpoints_status)
    app.router.add_get("/openapi.json", serve_openapi)
