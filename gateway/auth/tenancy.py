"""The request path's use of ``gateway.auth``: who is calling, what may they do, how much is left.

Order in the handler: authenticate (401, before the body is parsed) → authorise the
model (403) → rate limit (429 with ``Retry-After`` and ``x-ratelimit-*``) → admission.
The tenant then decides the request's tenant label (fair queueing), its default
priority (a client header may lower it, never raise it), and whether the routing
debug header is honoured. Tokens are charged up front (prompt estimate +
``max_tokens``) and settled against the response's usage afterwards.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from gateway.admission.queue import RateLimited
from gateway.admission.rewrite import rewrite_body
from gateway.auth import (
    KeyFileError,
    KeyStore,
    KeyStoreUnavailable,
    LimitDecision,
    RateLimiter,
    Tenant,
    build_key_store,
    build_rate_limiter,
    extract_key,
)
from gateway.auth.keyfile import FileKeyStore
from gateway.config import AuthConfig, ConfigError
from gateway.errors import AuthUnavailable, Forbidden, Unauthorized, quoted
from gateway.ops.metrics import GatewayMetrics
from gateway.request.parse import tenant_session_key
from gateway.request.types import InferenceRequest, Priority

__all__ = ["TenantAuth", "TenantRateLimited"]

log = logging.getLogger(__name__)

_DEFAULT_MAX_TOKENS = 256  # charged when the request names no max_tokens; settled afterwards


class TenantRateLimited(RateLimited):
    """429 carrying the tenant's ``x-ratelimit-*`` headers."""

    code = "tenant_rate_limit_exceeded"

    def __init__(self, message: str, decision: LimitDecision) -> None:
        super().__init__(message, retry_after=decision.retry_after_s)
        self.decision = decision

    def to_response(self, headers: dict[str, str] | None = None, **kw: Any):  # type: ignore[no-untyped-def]
        return super().to_response({**self.decision.headers(), **(headers or {})}, **kw)


class TenantAuth:
    def __init__(self, config: AuthConfig, metrics: GatewayMetrics) -> None:
        self._metrics = metrics
        try:
            self.keys: KeyStore = build_key_store(
                config, lambda reason: metrics.auth_store_fallbacks.labels(reason).inc()
            )
        except (KeyFileError, ValueError) as exc:
            raise ConfigError(f"auth: {exc}") from None
        self.limiter: RateLimiter = build_rate_limiter(
            config, lambda reason: metrics.rate_limit_fallbacks.labels(reason).inc()
        )
        self._config = config
        self._settling: set[asyncio.Task[None]] = set()

    def reconfigure(self, config: AuthConfig) -> None:
        """Hot reload: re-read the keys file; a bad file keeps the old keys (and is logged)."""
        self._config = config
        if isinstance(self.keys, FileKeyStore):
            try:
                self.keys.reload()
            except KeyFileError as exc:
                raise ConfigError(f"auth.keys_file: {exc}") from None

    def reload_keys_if_changed(self) -> bool:
        """For the file watch: re-read the keys file if it changed; a broken file keeps the old keys."""
        if not isinstance(self.keys, FileKeyStore):
            return False
        try:
            return self.keys.reload_if_changed()
        except KeyFileError:
            return False  # logged by the store, once per broken edit

    async def authenticate(self, headers: Mapping[str, str]) -> Tenant:
        raw = extract_key(headers)
        if not raw:
            self._metrics.auth_failures.labels("missing_key").inc()
            raise Unauthorized(
                "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
                code="missing_api_key",
            )
        try:
            tenant = await self.keys.lookup(raw)
        except KeyStoreUnavailable:
            self._metrics.auth_failures.labels("store_unavailable").inc()
            raise AuthUnavailable("the API key store is unreachable; retry shortly", retry_after=1) from None
        if tenant is None:
            self._metrics.auth_failures.labels("invalid_key").inc()
            raise Unauthorized("Incorrect API key provided.")
        return tenant

    def authorize(self, tenant: Tenant, request: InferenceRequest, priority_given: bool) -> None:
        if not tenant.allows_model(request.model):
            self._metrics.auth_failures.labels("model_not_allowed").inc()
            raise Forbidden(f"this key may not use model {quoted(request.model)}", param="model")
        request.tenant = tenant.name
        if request.session_id is not None:  # neither follows nor moves another tenant's pin
            request.session_id = tenant_session_key(tenant.name, request.session_id)
        if not priority_given or Priority(request.priority).rank < Priority(tenant.priority).rank:
            request.priority = tenant.priority  # a header may lower the tenant's priority, never raise it
        if not tenant.debug:
            request.debug = False
        if "priority" in request.body:
            # The engines' own priority scheduling reads this field: a tenant must not raise
            # itself there either. admission.engine_priority sets it from the clamped class.
            del request.body["priority"]
            rewrite_body(request)

    async def limit(self, tenant: Tenant, request: InferenceRequest) -> tuple[LimitDecision, int]:
        """Take from the tenant's buckets; raise 429 if empty. Returns the decision and tokens charged."""
        if not tenant.limited:
            return LimitDecision(allowed=True, source="unlimited"), 0
        charged = request.est_prompt_tokens + _max_tokens(request)
        decision = await self.limiter.acquire(tenant, charged)
        if not decision.allowed:
            self._metrics.rate_limited.labels(tenant.name).inc()
            raise TenantRateLimited(
                f"Rate limit reached for tenant {tenant.name!r} on {decision.limited_by}; "
                f"retry in {decision.retry_after_s:.1f}s",
                decision,
            )
        return decision, charged

    def settle_later(
        self, tenant: Tenant, charged: int, request: InferenceRequest, failed: bool, abandoned: bool = False
    ) -> None:
        """Correct the token bucket with the real usage, off the response path.

        The engine's usage when it sent one; else, when tokens were streamed (the client
        left early, the stream broke), what was streamed — a disconnect must not refund
        work the engine did; else, when the client left (``abandoned``) after the request
        was sent to a replica (not while it waited in the gateway's pool or connected), its
        prompt (the replica took it in: a client that gave up on every answer was refunded
        all of it); else a failed request is refunded in full (no engine did work for it)
        and a successful one keeps its up-front charge.
        """
        context = request.context
        usage = context.usage
        if not charged:
            return
        if usage is not None:
            actual = usage.prompt_tokens + usage.completion_tokens
        elif context.streamed_chunks:
            actual = request.est_prompt_tokens + context.streamed_chunks
        elif abandoned and context.sent:
            actual = request.est_prompt_tokens
        elif failed:
            actual = 0
        else:
            return
        task = asyncio.get_running_loop().create_task(self.limiter.settle(tenant, charged, actual))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def close(self) -> None:
        await asyncio.gather(*self._settling, return_exceptions=True)
        await self.limiter.close()
        await self.keys.close()


def _max_tokens(request: InferenceRequest) -> int:
    """The completion tokens the request may ask for: its limit (256 if none) times its choices
    (``n``, completions' ``best_of``: each is generated in full)."""
    limit = _DEFAULT_MAX_TOKENS
    for field in ("max_completion_tokens", "max_tokens", "max_output_tokens"):  # the last: Responses
        value = request.body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            limit = value
            break
    choices = 1
    for field in ("n", "best_of"):
        value = request.body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > choices:
            choices = value
    return limit * choices
