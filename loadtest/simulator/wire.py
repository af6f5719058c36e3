"""vLLM 0.32's OpenAI wire format: ids, response bodies, SSE chunks, usage and error envelopes.

Kept apart from the HTTP handlers so every shape sits in one place, next to the real answers
it copies (tests/e2e_vllm/captures/probes.vllm.txt): field order, nulls and all, because
clients and the gateway see exactly these bytes.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

import xxhash
from aiohttp import web

from .config import SimConfig

VLLM_VERSION = "0.32.0"
SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
_JSON_SEP = (",", ":")


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=_JSON_SEP)


def json_response(obj: Any, status: int = 200) -> web.Response:
    """Compact JSON with vLLM's bare ``Content-Type: application/json`` (no charset)."""
    return web.Response(body=dumps(obj).encode(), status=status, content_type="application/json")


def new_id(prefix: str) -> str:
    """vLLM's ids: ``chatcmpl-``/``cmpl-``/``modelperm-`` and 16 hex digits."""
    return f"{prefix}-{secrets.token_hex(8)}"


def system_fingerprint(cfg: SimConfig) -> str:
    """``vllm-<version>-<8 hex>``: stable for one replica configuration, as vLLM's."""
    key = f"{cfg.model}|{cfg.block_size}|{cfg.kv_blocks}|{cfg.max_model_len}".encode()
    return f"vllm-{VLLM_VERSION}-{xxhash.xxh32_intdigest(key):08x}"


# ---- errors -------------------------------------------------------------------------------


def error_response(status: int, message: str, type_: str, param: str | None = None) -> web.Response:
    """vLLM's error envelope, keys in its order: message, type, param, code."""
    return json_response(
        {"error": {"message": message, "type": type_, "param": param, "code": status}}, status
    )


def bad_request(
    message: str, param: str | None = None, value: Any = None, show_value: bool = True
) -> web.Response:
    """A 400 raised by vLLM's request checks: ``... (parameter=P, value=V)`` in the message."""
    if param is not None:
        suffix = f"parameter={param}, value={value}" if show_value else f"parameter={param}"
        message = f"{message} ({suffix})"
    return error_response(400, message, "BadRequestError", param)


def describe_input(value: Any) -> Any:
    """How vLLM's validation errors show the offending input."""
    if isinstance(value, dict):
        return f"<dict of {len(value)} items>"
    if isinstance(value, list):
        return f"<list of {len(value)} items>"
    return value


def validation_error(
    kind: str, loc: str, msg: str, value: Any, ctx: dict[str, Any] | None = None
) -> web.Response:
    """A request-schema error as vLLM 0.32 renders pydantic's: type ``Bad Request``, param = loc."""
    detail: dict[str, Any] = {"type": kind, "loc": loc, "msg": msg, "input": describe_input(value)}
    if ctx is not None:
        detail["ctx"] = ctx
    return error_response(400, f"1 validation error:\n  {detail!r}", "Bad Request", loc)


# ---- /v1/models ---------------------------------------------------------------------------


def models_body(cfg: SimConfig) -> dict[str, Any]:
    now = int(time.time())
    permission = {
        "id": new_id("modelperm"),
        "object": "model_permission",
        "created": now,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    card = {
        "id": cfg.model,
        "object": "model",
        "created": now,
        "owned_by": cfg.engine,
        "root": cfg.model,
        "parent": None,
        "max_model_len": cfg.max_model_len,
        "permission": [permission],
    }
    return {"object": "list", "data": [card]}


# ---- usage --------------------------------------------------------------------------------


def usage(
    prompt: int, completion: int, cached: int, created: int, chat: bool, streaming: bool
) -> dict[str, Any]:
    """vLLM's usage: chat adds ``created_cache_tokens``; the full body adds the null fields."""
    details: dict[str, Any] = {"cached_tokens": cached}
    if chat:
        details["created_cache_tokens"] = created
    elif not streaming:
        details["created_cache_tokens"] = None
    if not streaming:
        details["multimodal_tokens"] = None
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": details,
    }
    if not streaming:
        out["completion_tokens_details"] = None
    return out


# ---- full (non-streaming) bodies ------------------------------------------------------------


def completion_body(
    cfg: SimConfig, text: str, finish: str | None, use: dict[str, Any], kv_params: Any, chat: bool
) -> dict[str, Any]:
    head: dict[str, Any] = {
        "id": new_id("chatcmpl" if chat else "cmpl"),
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": cfg.model,
    }
    if chat:
        message = {
            "role": "assistant",
            "content": text,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "reasoning": None,
        }
        choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None}
        choice.update(finish_reason=finish, stop_reason=None, token_ids=None, routed_experts=None)
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
        choice.update(token_ids=None, prompt_logprobs=None, prompt_token_ids=None, routed_experts=None)
    body = {**head, "choices": [choice], "service_tier": None, "system_fingerprint": system_fingerprint(cfg)}
    body["usage"] = use
    if chat:
        body.update(prompt_logprobs=None, prompt_token_ids=None, prompt_text=None)
    body.update(kv_transfer_params=kv_params, ec_transfer_params=None, metrics=None)
    return body


# ---- SSE chunks -------------------------------------------------------------------------------


class ChunkWriter:
    """Builds one stream's chunks; the last one before ``[DONE]`` carries system_fingerprint."""

    def __init__(self, cfg: SimConfig, chat: bool) -> None:
        self.cfg = cfg
        self.chat = chat
        self.head: dict[str, Any] = {
            "id": new_id("chatcmpl" if chat else "cmpl"),
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": cfg.model,
        }

    def role(self) -> str:
        """Chat's opening chunk: the assistant role with empty content."""
        delta = {"role": "assistant", "content": ""}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        return dumps({**self.head, "choices": [choice], "prompt_token_ids": None, "prompt_text": None})

    def token(self, text: str, finish: str | None, last: bool) -> str:
        """A text chunk; with `finish` it also ends the choice (``last``: nothing but [DONE] follows)."""
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "logprobs": None}
            choice["finish_reason"] = finish
            if finish is not None:
                choice["stop_reason"] = None
            choice["token_ids"] = None
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
            }
            choice.update(prompt_token_ids=None, token_ids=None)
        body: dict[str, Any] = {**self.head, "choices": [choice]}
        if last:
            body["system_fingerprint"] = system_fingerprint(self.cfg)
        return dumps(body)

    def usage(self, use: dict[str, Any]) -> str:
        body = {**self.head, "choices": [], "usage": use, "system_fingerprint": system_fingerprint(self.cfg)}
        return dumps(body)
