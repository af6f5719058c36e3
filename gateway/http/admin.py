"""``/admin/endpoints``: list, add, drain, undrain and remove endpoints at run time.

Closed unless ``auth.admin_key_sha256`` is configured: then 404, as if the routes did
not exist, so an unconfigured gateway exposes nothing. The key travels as
``Authorization: Bearer <key>`` (or ``x-admin-key``) and is compared by its SHA-256,
in constant time; the raw key is never stored or logged.

Endpoints added here belong to the ``admin`` source (see ``FleetMembership``): they
live until removed or until the process restarts. Endpoints from the config file or
discovery cannot be removed here (their source would add them back); drain them.
"""

from __future__ import annotations

import hmac
import json
import time
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from gateway.auth.keys import hash_key
from gateway.config import ConfigError, EndpointConfig, format_validation_error
from gateway.errors import BadRequest, Conflict, NotFound, Unauthorized
from gateway.fleet.endpoint import Endpoint, public_url
from gateway.fleet.lora import LoraLoad
from gateway.fleet.membership import ADMIN_SOURCE
from gateway.fleet.networks import EndpointNetworks
from gateway.http.state import STATE, GatewayState

__all__ = ["add_admin_routes", "endpoint_row", "require_admin_key"]


def endpoint_row(state: GatewayState, endpoint: Endpoint, now: float) -> dict[str, Any]:
    m = endpoint.metrics
    return {
        "url": public_url(endpoint.url),  # user info is a credential: never shown
        "role": endpoint.role.value,
        "engine": endpoint.engine.value,
        "models": sorted(endpoint.models),
        "source": state.membership.source_of(endpoint.url),
        "healthy": endpoint.healthy,
        "ejected": endpoint.ejected,
        "breaker": state.breakers.state(endpoint).value,
        "draining": endpoint.draining,
        "in_flight": endpoint.in_flight,
        "in_flight_tokens": endpoint.in_flight_tokens,
        "waiting": m.waiting,
        "running": m.running,
        "kv_usage": m.kv_usage,
        "metrics_stale": m.stale,
        "metrics_age_s": round(now - m.scraped_at, 3) if m.scraped_at else None,
        "adapters": dict(endpoint.adapters),  # LoRA adapter -> base model
        "lora": _lora(m.lora),
        "adapters_in_flight": dict(endpoint.adapters_in_flight),
        **_ranks(state, endpoint, now),
    }


def _lora(load: LoraLoad | None) -> dict[str, Any] | None:
    """Adapters in use, as last scraped (vllm:lora_requests_info); None: not reported."""
    if load is None:
        return None
    return {"running": sorted(load.running), "waiting": sorted(load.waiting), "max_lora": load.max_lora}


def _ranks(state: GatewayState, endpoint: Endpoint, now: float) -> dict[str, Any]:
    """A data-parallel replica's rank targets (fleet/dp.py), each routed on its own."""
    if not endpoint.rank_targets:
        return {}
    targets = endpoint.rank_targets
    rows = [{"name": t.name, "dp_rank": t.dp_rank, **endpoint_row(state, t, now)} for t in targets]
    return {"data_parallel_ranks": rows}


def require_admin_key(state: GatewayState, request: web.Request) -> None:
    """404 when no admin key is configured (closed, as if absent); 401 for a missing or wrong key."""
    expected = state.config.auth.admin_key_sha256
    if not expected:
        raise NotFound(f"Unknown path {request.path}")
    given = request.headers.get("x-admin-key", "")
    authorization = request.headers.get("authorization", "")
    if authorization[:7].lower() == "bearer ":
        given = authorization[7:].strip()
    if not given or not hmac.compare_digest(hash_key(given), expected.lower()):
        state.metrics.auth_failures.labels("admin_key").inc()
        raise Unauthorized("a valid admin key is required", code="invalid_admin_key")


def _bad(message: str) -> BadRequest:
    return BadRequest(message, code="invalid_admin_request")


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.read() or b"{}")
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nested too deep
        raise _bad("request body must be valid JSON") from None
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    return body


def _target(state: GatewayState, request: web.Request, body: dict[str, Any]) -> Endpoint:
    url = body.get("url", request.query.get("url"))
    if not isinstance(url, str) or not url:
        raise _bad("give the endpoint's url (body field or ?url=)")
    url = url.rstrip("/")
    endpoint = state.registry.get(url)
    if endpoint is None:  # answers show URLs without user info: accept them back
        matches = [e for e in state.registry if e.base_url == url]
        endpoint = matches[0] if len(matches) == 1 else None
    if endpoint is None:
        try:
            shown = public_url(url)
        except ValueError:  # "http://[::1": no endpoint's URL, and no URL at all
            raise _bad(f"url is not a valid URL: {url[:200]!r}") from None
        raise NotFound(f"no endpoint {shown!r}", code="endpoint_not_found")
    return endpoint


def _networks(state: GatewayState) -> EndpointNetworks:
    config = state.config
    redis = (config.prefix.redis_url, config.sessions.redis_url, config.auth.redis_url)
    return EndpointNetworks.from_config(config.discovery, redis)


def _admin(handler):
    async def guarded(request: web.Request) -> web.StreamResponse:
        state = request.app[STATE]
        require_admin_key(state, request)
        change = request.method != "GET"
        if change and state.config.server.workers > 1 and state.admin_share is None:
            # Several workers but no way to reach the siblings: a change would reach one of them.
            raise Conflict(
                "admin changes need server.workers: 1, or workers started by `llm-gateway serve`;"
                " else edit the config file (reloaded on SIGHUP in every worker) or use discovery",
                code="not_supported_with_workers",
            )
        if change and state.admin_share is not None:
            async with state.admin_share.change():  # the sibling workers apply the same admin state
                return await handler(state, request)
        return await handler(state, request)

    return guarded


@_admin
async def list_endpoints(state: GatewayState, request: web.Request) -> web.Response:
    if state.shared_load is not None:  # workers > 1: the whole gateway's in-flight numbers
        state.shared_load.refresh(force=True)
    now = time.monotonic()
    return web.json_response({"endpoints": [endpoint_row(state, e, now) for e in state.registry]})


@_admin
async def add_endpoint(state: GatewayState, request: web.Request) -> web.Response:
    body = await _json_body(request)
    if "api_key_file" in body:
        # The caller picks the URL: reading a local file into its Authorization header would
        # hand any file the gateway can read (service-account token, keys) to that caller.
        raise _bad("api_key_file is not accepted here; give api_key, or use the config file")
    try:
        config = EndpointConfig.model_validate(body)
    except ValidationError as exc:
        raise _bad(format_validation_error(exc)) from None
    refusal = await _networks(state).refusal(config.url)
    if refusal is not None:
        raise _bad(f"url: {refusal}")
    owner = state.membership.source_of(config.url)
    if owner is not None:
        raise Conflict(f"endpoint {public_url(config.url)} already exists (from {owner})")
    replica = public_url(config.url).rstrip("/")
    if any(e.base_url == replica for e in state.registry):  # the same replica, other user info
        raise Conflict(f"endpoint {replica} already exists (under another URL)")
    try:
        state.membership.apply(ADMIN_SOURCE, [*state.membership.endpoints_of(ADMIN_SOURCE), config])
    except ConfigError as exc:
        raise _bad(str(exc)) from None
    endpoint = state.registry.get(config.url)
    assert endpoint is not None
    return web.json_response(endpoint_row(state, endpoint, time.monotonic()), status=201)


async def _set_draining(state: GatewayState, request: web.Request, draining: bool) -> web.Response:
    endpoint = _target(state, request, await _json_body(request))
    endpoint.draining = draining
    state.registry.rebuild()
    return web.json_response(endpoint_row(state, endpoint, time.monotonic()))


@_admin
async def drain_endpoint(state: GatewayState, request: web.Request) -> web.Response:
    return await _set_draining(state, request, True)


@_admin
async def undrain_endpoint(state: GatewayState, request: web.Request) -> web.Response:
    return await _set_draining(state, request, False)


@_admin
async def remove_endpoint(state: GatewayState, request: web.Request) -> web.Response:
    body = await _json_body(request) if request.can_read_body else {}
    endpoint = _target(state, request, body)
    owner = state.membership.source_of(endpoint.url)
    if owner != ADMIN_SOURCE:
        raise Conflict(f"endpoint {endpoint.name} comes from {owner}; change that source, or drain it here")
    remaining = [c for c in state.membership.endpoints_of(ADMIN_SOURCE) if c.url != endpoint.url]
    state.membership.apply(ADMIN_SOURCE, remaining)
    row = endpoint_row(state, endpoint, time.monotonic())
    return web.json_response({"removed": row})


def add_admin_routes(app: web.Application) -> None:
    app.router.add_get("/admin/endpoints", list_endpoints)
    app.router.add_post("/admin/endpoints", add_endpoint)
    app.router.add_delete("/admin/endpoints", remove_endpoint)
    app.router.add_post("/admin/endpoints/drain", drain_endpoint)
    app.router.add_post("/admin/endpoints/undrain", undrain_endpoint)
