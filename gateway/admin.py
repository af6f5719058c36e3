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

import hashlib
import hmac
import json
import time
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from gateway.config import ConfigError, EndpointConfig
from gateway.endpoints.membership import ADMIN_SOURCE
from gateway.errors import error_response
from gateway.state import STATE, GatewayState
from gateway.types import Endpoint

__all__ = ["add_admin_routes", "admin_refusal", "endpoint_row"]


def endpoint_row(state: GatewayState, endpoint: Endpoint, now: float) -> dict[str, Any]:
    m = endpoint.metrics
    return {
        "url": endpoint.url,
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
    }


def admin_refusal(state: GatewayState, request: web.Request) -> web.Response | None:
    expected = state.config.auth.admin_key_sha256
    if not expected:
        return error_response(404, f"Unknown path {request.path}", "invalid_request_error", "not_found")
    given = request.headers.get("x-admin-key", "")
    authorization = request.headers.get("authorization", "")
    if authorization[:7].lower() == "bearer ":
        given = authorization[7:].strip()
    digest = hashlib.sha256(given.encode()).hexdigest()
    if not given or not hmac.compare_digest(digest, expected.lower()):
        state.metrics.auth_failures.labels("admin_key").inc()
        return error_response(
            401, "a valid admin key is required", "authentication_error", "invalid_admin_key"
        )
    return None


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.read() or b"{}")
    except (ValueError, UnicodeDecodeError):
        raise _BadRequest("request body must be valid JSON") from None
    if not isinstance(body, dict):
        raise _BadRequest("request body must be a JSON object")
    return body


class _BadRequest(Exception):
    pass


def _target(state: GatewayState, request: web.Request, body: dict[str, Any]) -> Endpoint:
    url = body.get("url", request.query.get("url"))
    if not isinstance(url, str) or not url:
        raise _BadRequest("give the endpoint's url (body field or ?url=)")
    endpoint = state.registry.get(url.rstrip("/"))
    if endpoint is None:
        raise LookupError(url)
    return endpoint


def _admin(handler):
    async def guarded(request: web.Request) -> web.StreamResponse:
        state = request.app[STATE]
        refusal = admin_refusal(state, request)
        if refusal is not None:
            return refusal
        if request.method != "GET" and state.config.server.workers > 1:
            # Each worker process has its own fleet view; a change would reach one of them.
            return error_response(
                409,
                "admin changes need server.workers: 1; with several workers edit the config file"
                " (reloaded on SIGHUP in every worker) or use discovery",
                "invalid_request_error",
                "not_supported_with_workers",
            )
        try:
            return await handler(state, request)
        except _BadRequest as exc:
            return error_response(400, str(exc), "invalid_request_error", "invalid_admin_request")
        except LookupError as exc:
            return error_response(
                404, f"no endpoint {exc.args[0]!r}", "invalid_request_error", "endpoint_not_found"
            )

    return guarded


@_admin
async def list_endpoints(state: GatewayState, request: web.Request) -> web.Response:
    now = time.monotonic()
    return web.json_response({"endpoints": [endpoint_row(state, e, now) for e in state.registry]})


@_admin
async def add_endpoint(state: GatewayState, request: web.Request) -> web.Response:
    body = await _json_body(request)
    if "api_key_file" in body:
        # The caller picks the URL: reading a local file into its Authorization header would
        # hand any file the gateway can read (service-account token, keys) to that caller.
        raise _BadRequest("api_key_file is not accepted here; give api_key, or use the config file")
    try:
        config = EndpointConfig.model_validate(body)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg'].removeprefix('Value error, ')}"
            for e in exc.errors()
        )
        raise _BadRequest(problems) from None
    owner = state.membership.source_of(config.url)
    if owner is not None:
        return error_response(
            409, f"endpoint {config.url} already exists (from {owner})", "invalid_request_error", "conflict"
        )
    try:
        state.membership.apply(ADMIN_SOURCE, [*state.membership.endpoints_of(ADMIN_SOURCE), config])
    except ConfigError as exc:
        raise _BadRequest(str(exc)) from None
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
        return error_response(
            409,
            f"endpoint {endpoint.url} comes from {owner}; change that source, or drain it here",
            "invalid_request_error",
            "conflict",
        )
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
