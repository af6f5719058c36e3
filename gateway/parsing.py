"""OpenAI request body → :class:`InferenceRequest`, parsed and validated exactly once.

The canonical prompt text serialises each chat message's role and content in order,
so turn N+1 of a conversation extends turn N's text exactly; the prefix index
hashes it. The raw body is kept and forwarded byte for byte.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.errors import BadRequest
from gateway.types import ApiKind, InferenceRequest

__all__ = ["DEFAULT_OPTIONS", "PRIORITIES", "ParseOptions", "canonical_chat_prompt", "parse_request"]

PRIORITIES = ("critical", "standard", "sheddable")
# Separators that cannot appear in JSON-decoded text by accident in a way that
# matters: they only need to make (role, content) boundaries unambiguous.
_ROLE_SEP = "\x1e"
_MSG_SEP = "\x1f"
CHARS_PER_TOKEN = 4  # rough estimate, good enough for load accounting


def _content_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part_index, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise BadRequest(
                    f"messages[{index}].content[{part_index}] must be an object with a 'type'",
                    param=f"messages.{index}.content",
                )
            if part["type"] == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise BadRequest(
                        f"messages[{index}].content[{part_index}].text must be a string",
                        param=f"messages.{index}.content",
                    )
                parts.append(text)
            else:
                # Images, audio, files: a stable placeholder keeps the prefix aligned.
                parts.append(f"<{part['type']}>")
        return "".join(parts)
    raise BadRequest(
        f"messages[{index}].content must be a string or a list of parts", param=f"messages.{index}.content"
    )


def canonical_chat_prompt(messages: list[Any]) -> str:
    pieces = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"messages[{index}] must be an object", param=f"messages.{index}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise BadRequest(
                f"messages[{index}].role must be a non-empty string", param=f"messages.{index}.role"
            )
        text = _content_text(message.get("content"), index)
        if message.get("tool_calls"):
            text += "<tool_calls>" + json.dumps(message["tool_calls"], sort_keys=True, separators=(",", ":"))
        pieces.append(role + _ROLE_SEP + text + _MSG_SEP)
    return "".join(pieces)


def _completion_prompt(prompt: Any) -> str:
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("'prompt' must not be empty", param="prompt")
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return _MSG_SEP.join(prompt)
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return " ".join(map(str, prompt))  # token ids: hash their decimal text
        if all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
            return _MSG_SEP.join(" ".join(map(str, p)) for p in prompt)
    raise BadRequest(
        "'prompt' must be a non-empty string, list of strings, or list of token ids", param="prompt"
    )


def _embedding_input(value: Any) -> str:
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value:
        return _MSG_SEP.join(str(v) for v in value)
    raise BadRequest("'input' must be a non-empty string or list", param="input")


@dataclass(frozen=True, slots=True)
class ParseOptions:
    """Where session, priority and tenant come from (configurable names)."""

    session_header: str = "x-session-id"
    session_body_fields: tuple[str, ...] = ("user",)
    priority_header: str = "x-priority"
    tenant_header: str = "x-tenant-id"
    max_json_depth: int = 32


DEFAULT_OPTIONS = ParseOptions()


def _session_id(headers: Mapping[str, str], body: dict[str, Any], options: ParseOptions) -> str | None:
    session_id = headers.get(options.session_header)
    if session_id:
        return session_id
    for field_name in options.session_body_fields:
        value = body.get(field_name)
        if isinstance(value, str | int) and not isinstance(value, bool) and str(value):
            return str(value)
    return None


def parse_request(
    api: ApiKind,
    raw_body: bytes,
    *,
    request_id: str,
    headers: Mapping[str, str],
    options: ParseOptions = DEFAULT_OPTIONS,
) -> InferenceRequest:
    try:
        body = json.loads(raw_body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a non-empty string", param="model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")

    if api is ApiKind.CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' is required and must be a non-empty array", param="messages")
        prompt = canonical_chat_prompt(messages)
    elif api is ApiKind.COMPLETIONS:
        if "prompt" not in body:
            raise BadRequest("'prompt' is required", param="prompt")
        prompt = _completion_prompt(body["prompt"])
    else:
        prompt = _embedding_input(body.get("input"))
        stream = False

    priority_header = options.priority_header
    priority = headers.get(priority_header, "standard").strip().lower() or "standard"
    if priority not in PRIORITIES:
        raise BadRequest(
            f"header {priority_header}: {priority!r} is not one of {list(PRIORITIES)}", param=priority_header
        )
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
    )
