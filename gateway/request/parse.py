"""API request body → :class:`InferenceRequest`, parsed and validated exactly once.

The pipeline of this stage: raw-body guards (:mod:`~gateway.request.guards`), field
rules (:mod:`~gateway.request.fields`), prompt canonicalisation
(:mod:`~gateway.request.prompt`), then the request's own fields: model, stream,
session id, priority, tenant. The parsed body is kept; it is what the proxy sends on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import xxhash

from gateway.errors import BadRequest, quoted
from gateway.request.apis import api_prompt
from gateway.request.fields import check_fields
from gateway.request.guards import load_object
from gateway.request.multipart import Form
from gateway.request.prompt import canonical_chat_prompt, text_or_tokens
from gateway.request.slo import SloOptions, parse_slo
from gateway.request.types import CHARS_PER_TOKEN, ApiKind, InferenceRequest, Priority

__all__ = [
    "CHAIN_SOURCE",
    "DEFAULT_OPTIONS",
    "ParseOptions",
    "default_session_sources",
    "parse_request",
    "session_key",
    "session_sources",
    "tenant_session_key",
]

_PRIORITY_NAMES = [p.value for p in Priority]
_PRIORITIES = {p.value: p for p in Priority}  # a dict lookup, not the enum's slower call


CHAIN_SOURCE = "previous_response_id"
# What agent clients send: Claude Code, Codex (both spellings), OpenCode; OpenAI's body field.
_AGENT_HEADERS = ("x-claude-code-session-id", "session_id", "session-id", "x-session-affinity")


@lru_cache(maxsize=64)  # per request otherwise (a tenth of parse_request's time)
def default_session_sources(header: str, body_fields: tuple[str, ...]) -> tuple[str, ...]:
    """``sessions.sources`` when not configured: the configured header, the agent CLIs'
    headers, ``prompt_cache_key``, the configured body fields, then a Responses chain."""
    headers = [header, *(h for h in _AGENT_HEADERS if h != header)]
    fields = ["prompt_cache_key", *(f for f in body_fields if f != "prompt_cache_key")]
    return (*(f"header:{h}" for h in headers), *(f"body:{f}" for f in fields), CHAIN_SOURCE)


@dataclass(frozen=True, slots=True)
class ParseOptions:
    """Where session, priority and tenant come from (configurable names), and the body's shape limits."""

    session_header: str = "x-session-id"
    session_body_fields: tuple[str, ...] = ("user",)
    priority_header: str = "x-priority"
    tenant_header: str = "x-tenant-id"
    max_json_depth: int = 32
    max_json_containers: int = 100_000
    # header:<name> / body:<field> (dotted for nested) / CHAIN_SOURCE, tried in order, the
    # first present wins; empty: default_session_sources(session_header, session_body_fields).
    # A Responses request with previous_response_id that reaches CHAIN_SOURCE takes the
    # session of the chain it continues (looked up by the handler).
    session_sources: tuple[str, ...] = ()
    slo: SloOptions = field(default_factory=SloOptions)


DEFAULT_OPTIONS = ParseOptions()


def session_sources(options: ParseOptions) -> tuple[str, ...]:
    """Where a request's session id is looked for, in order: configured, or the defaults."""
    return options.session_sources or default_session_sources(
        options.session_header, options.session_body_fields
    )


def session_key(client_id: str) -> str:
    """A client's session id as stored: 32 hex digits whatever its length (a 1 MB ``user``
    field must not become a 1 MB key in memory and in Redis)."""
    return xxhash.xxh3_128_hexdigest(client_id.encode("utf-8", "surrogatepass"))


def tenant_session_key(tenant: str, key: str) -> str:
    """A session key (:func:`session_key`) scoped to its tenant, as stored when auth is on: the
    same id from two tenants (a ``user`` field, a conversation counter) is two sessions."""
    return session_key(f"{tenant}\0{key}")


def _body_value(body: dict[str, Any], dotted: str) -> Any:
    value: Any = body
    for part in dotted.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


@lru_cache(maxsize=64)
def _split_sources(sources: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """``header:x`` → ``("header", "x")`` (``CHAIN_SOURCE`` → ``(CHAIN_SOURCE, "")``), once per
    configuration, not per request."""
    return tuple((kind, name) for kind, _, name in (source.partition(":") for source in sources))


def _session_id(headers: Mapping[str, str], body: dict[str, Any], options: ParseOptions) -> str | None:
    for kind, name in _split_sources(session_sources(options)):
        if kind == CHAIN_SOURCE:
            if isinstance(body.get(CHAIN_SOURCE), str):
                return None  # the chain's session: looked up by the handler
            continue
        if kind == "header":
            session_id = headers.get(name)
            if session_id:
                return session_key(session_id)
            continue
        value = _body_value(body, name)
        if isinstance(value, str | int) and not isinstance(value, bool) and str(value):
            return session_key(str(value))
    return None


# The engines' own P/D hand-over: vLLM's KV-connector parameters (NIXL: which engine and blocks to
# pull from, at which host and port) and SGLang's bootstrap server and room. Only the gateway's
# P/D coordinator may set them: from a client, a decode replica would pull another request's
# (another tenant's) KV blocks, or connect wherever the client said.
_ENGINE_PD_FIELDS = frozenset({"kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room"})


def _without_engine_fields(body: dict[str, Any], form: Form | None) -> bytes:
    for name in _ENGINE_PD_FIELDS:
        body.pop(name, None)
    if form is not None:  # an audio form's text fields: the same parts without these
        return form.encode(body)
    return json.dumps(body, separators=(",", ":")).encode()


def parse_request(
    api: ApiKind,
    raw_body: bytes,
    *,
    request_id: str,
    headers: Mapping[str, str],
    options: ParseOptions = DEFAULT_OPTIONS,
    default_model: str | None = None,
    path: str | None = None,
    form: Form | None = None,
) -> InferenceRequest:
    """``default_model``: the model of a body without one (tokenize: vLLM serves its only
    model); ``path``: the upstream path when it is not the API's own (``/rerank``); ``form``:
    a multipart body's parts (audio), whose text fields stand for the JSON body."""
    if form is None:
        body, numbers = load_object(raw_body, options.max_json_depth, options.max_json_containers)
    else:
        body, numbers = form.fields(), None
    model = body.get("model")
    if model is None and default_model is not None:
        model = default_model
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a non-empty string", param="model")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    stream = bool(stream) and api.streams
    check_fields(api, body)

    if api is ApiKind.CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' is required and must be a non-empty array", param="messages")
        prompt = canonical_chat_prompt(messages)
    elif api is ApiKind.COMPLETIONS:
        if "prompt" not in body:
            raise BadRequest("'prompt' is required", param="prompt")
        prompt = text_or_tokens(body["prompt"], "prompt")
    elif api is ApiKind.EMBEDDINGS:
        prompt = text_or_tokens(body.get("input"), "input")
    else:
        prompt = api_prompt(api, body)

    priority_header = options.priority_header
    name = headers.get(priority_header, "").strip().lower() or Priority.STANDARD
    priority = _PRIORITIES.get(name)
    if priority is None:
        raise BadRequest(
            f"header {priority_header}: {quoted(name)} is not one of {_PRIORITY_NAMES}", param=priority_header
        )
    if numbers is not None:
        numbers.check_all()
    if not _ENGINE_PD_FIELDS.isdisjoint(body):
        raw_body = _without_engine_fields(body, form)
    return InferenceRequest(
        request_id=request_id,
        api=api,
        model=model,
        body=body,
        raw_body=raw_body,
        stream=stream,
        prompt_text=prompt,
        est_prompt_tokens=max(1, len(prompt) // CHARS_PER_TOKEN),
        session_id=_session_id(headers, body, options),
        priority=priority,
        tenant=headers.get(options.tenant_header) or "default",
        debug=headers.get("x-gateway-debug") == "1",
        headers=headers,
        path=path,
        slo=parse_slo(headers, priority, options.slo),
        form=form,
    )
