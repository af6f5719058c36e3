"""Request checks in vLLM 0.32's order, with its error answers.

Schema errors (bad JSON, a missing or mistyped field) come back as pydantic renders them
(type ``Bad Request``, param ``body.<field>``); length errors as vLLM's own checks word them
(type ``BadRequestError``, ``(parameter=..., value=...)``). A prompt that fits but leaves no room
for ``max_tokens`` is not an error: vLLM clamps max_tokens to what fits in max_model_len.
"""

from __future__ import annotations

import json
from collections.abc import Container
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from .config import SimConfig
from .tokenizer import encode, encode_chat
from .wire import bad_request, error_response, validation_error


class Rejected(Exception):
    """The request is answered with `response` before it reaches the engine."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.status)
        self.response = response


@dataclass
class Parsed:
    body: dict[str, Any]
    tokens: list[int]
    max_tokens: int  # already clamped to max_model_len - prompt
    stream: bool
    include_usage: bool
    priority: int


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except UnicodeDecodeError:
        raise Rejected(validation_error("json_invalid", "body.0", "JSON decode error", {})) from None
    except json.JSONDecodeError as e:
        ctx = {"error": e.msg}
        raise Rejected(
            validation_error("json_invalid", f"body.{e.pos}", "JSON decode error", {}, ctx)
        ) from None
    if not isinstance(body, dict):
        msg = "Input should be a valid dictionary or object to extract fields from"
        raise Rejected(validation_error("model_attributes_type", "body", msg, body))
    return body


def _int(body: dict[str, Any], name: str) -> int | None:
    """pydantic's lax int: whole floats and numeric strings pass, anything else is a 400."""
    value = body.get(name)
    if value is None:
        return None
    loc = f"body.{name}"
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if value.is_integer():
            return int(value)
        msg = "Input should be a valid integer, got a number with a fractional part"
        raise Rejected(validation_error("int_from_float", loc, msg, value))
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            msg = "Input should be a valid integer, unable to parse string as an integer"
            raise Rejected(validation_error("int_parsing", loc, msg, value)) from None
    raise Rejected(validation_error("int_type", loc, "Input should be a valid integer", value))


def _completion_prompt(prompt: Any) -> list[int]:
    if isinstance(prompt, str):
        return encode(prompt)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        if len(prompt) == 1:
            return _completion_prompt(prompt[0])
        msg = "batched prompts are not supported by the simulator"
        raise Rejected(bad_request(msg, "prompt", show_value=False))
    if prompt is None or isinstance(prompt, list):
        return []  # vLLM: "Either prompt or prompt_embeds must be provided and non-empty."
    raise Rejected(
        bad_request("prompt must be a string, a list of token ids or a one-element list", "prompt")
    )


def _tokens(body: dict[str, Any], chat: bool) -> list[int]:
    if not chat:
        tokens = _completion_prompt(body.get("prompt"))
        if not tokens:
            msg = "Either prompt or prompt_embeds must be provided and non-empty."
            raise Rejected(bad_request(msg, "prompt", show_value=False))
        return tokens
    messages = body.get("messages")
    if not messages:
        raise Rejected(bad_request("messages must be a non-empty list", "messages", show_value=False))
    try:
        return encode_chat(messages)
    except ValueError as e:
        raise Rejected(bad_request(str(e), "messages", show_value=False)) from None


def _schema(body: dict[str, Any], chat: bool) -> None:
    """The pydantic-level checks vLLM runs before its handler sees the request."""
    if chat:
        if "messages" not in body:
            raise Rejected(validation_error("missing", "body.messages", "Field required", body))
        if not isinstance(body["messages"], list):
            msg = "Input should be a valid list"
            raise Rejected(validation_error("list_type", "body.messages", msg, body["messages"]))
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        msg = "Input should be a valid dictionary or object to extract fields from"
        raise Rejected(validation_error("model_attributes_type", "body.stream_options", msg, opts))


def parse_request(body: dict[str, Any], chat: bool, cfg: SimConfig, adapters: Container[str] = ()) -> Parsed:
    """Validate a generation request; raise `Rejected` with vLLM's answer when it is refused.
    ``adapters``: the LoRA adapters served, valid models too."""
    _schema(body, chat)
    requested = _int(body, "max_completion_tokens") if chat else None
    if requested is None:
        requested = _int(body, "max_tokens")
    priority = _int(body, "priority") or 0
    model = body.get("model")
    if model is not None and model != cfg.model and model not in adapters:  # no model: the base
        msg = f"The model `{model}` does not exist. Valid aliases: {cfg.model}."
        raise Rejected(error_response(404, msg, "NotFoundError", "model"))
    limit = cfg.max_model_len
    if requested is not None and requested > limit:
        msg = (
            f"max_tokens={requested} cannot be greater than max_model_len={limit}. "
            "Please request fewer output tokens."
        )
        raise Rejected(bad_request(msg, "max_tokens", requested))
    tokens = _tokens(body, chat)
    if len(tokens) > limit:
        shown = min(len(tokens), limit + 1)  # vLLM stops counting one past the limit
        msg = (
            f"This model's maximum context length is {limit} tokens. However, your prompt contains at "
            f"least {shown} input tokens, which exceeds this limit even without any output tokens. "
            "Please reduce the length of the input prompt."
        )
        raise Rejected(bad_request(msg, "input_tokens", shown))
    wanted = requested if requested is not None else cfg.default_max_tokens
    max_tokens = min(wanted, limit - len(tokens))
    if max_tokens < 1:
        raise Rejected(
            bad_request(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
        )
    opts = body.get("stream_options") or {}
    return Parsed(
        body=body,
        tokens=tokens,
        max_tokens=max_tokens,
        stream=bool(body.get("stream", False)),
        include_usage=bool(opts.get("include_usage", False)),
        priority=priority,
    )
