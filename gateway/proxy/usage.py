"""The engine's token counts for an answer: its ``usage`` object, read so no client can steer it.

Tenants are charged these counts and the cache metrics come from them, so they must be the
engine's own. Answer content is the client's to steer (a tool call's input, an echoed JSON
schema or ``user`` field), and may hold objects named like usage counts, or a ``"usage"`` of
its own. So:

- a whole answer body is decoded for its top-level ``usage`` only (msgspec skips the rest);
  past 64 KiB (an embeddings batch) the last ``"usage"`` key of its tail is tried first;
- a stream's is the last ``"usage"`` key of its tail (the usage event comes last in every
  API). A client that pushes it out of the tail (a long echoed ``user``) only makes the
  tenant be charged what was streamed instead (:meth:`TenantAuth.settle_later`).

Each API has its own names; reading none is no usage (the request keeps its up-front charge).
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import msgspec

from gateway.fleet.endpoint import Endpoint, EngineKind
from gateway.proxy.hooks import RequestHooks
from gateway.request.types import ApiKind, InferenceRequest, Usage

__all__ = ["answer_usage", "report_usage", "stream_usage"]

log = logging.getLogger(__name__)

_TAIL_BYTES = 2048
_DECODE_WHOLE_BYTES = 1 << 16
_USAGE_OPENING = re.compile(rb"\s*:\s*\{")  # after a "usage" key: its object
_MAX_COUNT = 10**15  # a longer number is no token count (10**400 from a broken replica overflowed)
_PLAIN_JSON = json.JSONDecoder()

# Per API: its usage object's prompt, completion and cached-token counts (the last one a path).
_OPENAI_NAMES = ("prompt_tokens", "completion_tokens", ("prompt_tokens_details", "cached_tokens"))
_RESPONSES_NAMES = ("input_tokens", "output_tokens", ("input_tokens_details", "cached_tokens"))
_MESSAGES_NAMES = ("input_tokens", "output_tokens", ("cache_read_input_tokens",))
# Anthropic's (and vLLM's) input_tokens leave out what was read from or written to the cache:
# the prompt is all three. SGLang's input_tokens are the whole prompt already.
_MESSAGES_CACHE = ("cache_read_input_tokens", "cache_creation_input_tokens")


def report_usage(
    request: InferenceRequest, endpoint: Endpoint, hooks: RequestHooks, answer: bytes, *, whole: bool
) -> None:
    """The answer's usage, for the request (its tenant's charge) and the hooks (cache metrics):
    ``answer`` is the whole body (``whole``), else the stream's tail."""
    read = answer_usage if whole else stream_usage
    usage = read(answer, request.api, endpoint.engine is EngineKind.SGLANG)
    if usage is not None:
        request.context.usage = usage
        hooks.on_usage(request, endpoint, usage)


class _TopLevel(msgspec.Struct):
    usage: dict[str, Any] | None = None
    input_tokens: Any = None  # Anthropic's count_tokens answer is {"input_tokens": N} itself


_TOP_LEVEL = msgspec.json.Decoder(_TopLevel)


def answer_usage(body: bytes, api: ApiKind, cache_in_input: bool = False) -> Usage | None:
    """The usage of a whole (non-streamed) answer. ``cache_in_input``: the engine's Messages
    ``input_tokens`` already count cached tokens (SGLang). Never raises."""
    if len(body) > _DECODE_WHOLE_BYTES and api is not ApiKind.COUNT_TOKENS:
        usage = stream_usage(body[-_TAIL_BYTES:], api, cache_in_input)
        if usage is not None:
            return usage
    try:
        answer = _TOP_LEVEL.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None
    if api is ApiKind.COUNT_TOKENS:
        prompt = _count(answer.input_tokens)
        return None if prompt is None else Usage(prompt_tokens=prompt, completion_tokens=0)
    return _counts(answer.usage, api, cache_in_input) if answer.usage is not None else None


def stream_usage(tail: bytes, api: ApiKind, cache_in_input: bool = False) -> Usage | None:
    """The usage in a stream's tail (its last reads): the last ``"usage"`` object. Never raises."""
    usage = _last_usage_object(tail)
    return None if usage is None else _counts(usage, api, cache_in_input)


def _last_usage_object(payload: bytes) -> dict[str, Any] | None:
    """The object of the last ``"usage"`` key: one whose quote is escaped is inside a string."""
    end = len(payload)
    while (at := payload.rfind(b'"usage"', 0, end)) != -1:
        if at == 0 or payload[at - 1] != 0x5C:  # not \"usage"
            break
        end = at
    opening = _USAGE_OPENING.match(payload, at + 7) if at != -1 else None
    if opening is None:
        return None
    try:
        usage, _ = _PLAIN_JSON.raw_decode(payload[opening.end() - 1 :].decode("utf-8", "replace"))
    except (ValueError, RecursionError):
        return None
    return usage if isinstance(usage, dict) else None


def _counts(usage: dict[str, Any], api: ApiKind, cache_in_input: bool) -> Usage | None:
    names = (
        _RESPONSES_NAMES
        if api is ApiKind.RESPONSES
        else _MESSAGES_NAMES
        if api is ApiKind.MESSAGES
        else _OPENAI_NAMES
    )
    prompt = _count(usage.get(names[0]))
    if prompt is None:
        return None
    cached: object = usage
    for key in names[2]:
        cached = cached.get(key) if isinstance(cached, dict) else None
    if api is ApiKind.MESSAGES and not cache_in_input:
        prompt += sum(_count(usage.get(key)) or 0 for key in _MESSAGES_CACHE)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=_count(usage.get(names[1])) or 0,
        cached_tokens=_count(cached) or 0,
    )


def _count(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _MAX_COUNT:
        return value
    return None
