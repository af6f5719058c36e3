"""Prompt canonicalisation for the APIs beyond chat and completions.

The Responses API (``instructions`` + ``input`` items), Anthropic Messages (``system`` +
``messages`` of content blocks) and the pooling/tokenizer family (rerank, score, classify,
pooling, tokenize, detokenize). The text is what the prefix index hashes, so the rules
are those of :mod:`gateway.request.prompt`: tools first (engines render them at the top
of the template), then the system text, then one ``role SEP text SEP`` piece per turn, so
turn N+1 of an agent loop extends turn N's text exactly. What a client varies between
turns without changing the prompt — Anthropic ``cache_control`` markers, item ids — is
left out.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.errors import BadRequest
from gateway.request.guards import refused_number_text
from gateway.request.prompt import NOT_PROMPT, canonical_chat_prompt, media_placeholder, text_or_tokens
from gateway.request.types import FORM_APIS, ApiKind

__all__ = ["api_prompt"]

_ROLE_SEP = "\x1e"
_MSG_SEP = "\x1f"


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=refused_number_text)


def _piece(role: str, text: str) -> str:
    return role + _ROLE_SEP + text + _MSG_SEP


def _tools(body: dict[str, Any]) -> str:
    tools = body.get("tools")
    if not tools:
        return ""
    return _piece("tools", _json([_strip(t) for t in tools]))


def _strip(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in NOT_PROMPT}
    return value


def _part_text(part: Any, where: str) -> str:
    if isinstance(part, str):
        return part
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise BadRequest(f"{where} must be an object with a 'type'", param=where)
    kind = part["type"]
    if kind in ("text", "input_text", "output_text", "refusal"):
        text = part.get("text", part.get("refusal"))
        if not isinstance(text, str):
            raise BadRequest(f"{where}.text must be a string", param=where)
        return text
    if kind in ("tool_use", "tool_result", "function_call", "function_call_output", "thinking"):
        return f"<{kind}>" + _json(_strip(part))
    return media_placeholder(part)  # images, files, documents


def _content(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_part_text(p, f"{where}[{i}]") for i, p in enumerate(content))
    raise BadRequest(f"{where} must be a string or an array of content blocks", param=where)


# ---- Responses -------------------------------------------------------------------------


def _responses_item(item: Any, index: int) -> str:
    where = f"input[{index}]"
    if not isinstance(item, dict):
        raise BadRequest(f"{where} must be an object", param="input")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if not isinstance(role, str) or not role:
            raise BadRequest(f"{where}.role must be a non-empty string", param="input")
        return _piece(role, _content(item.get("content"), f"{where}.content"))
    if not isinstance(kind, str):
        raise BadRequest(f"{where}.type must be a string", param="input")
    return _piece(kind, _json(_strip(item)))


def _responses_prompt(body: dict[str, Any]) -> str:
    text = _tools(body)
    instructions = body.get("instructions")
    if instructions:
        text += _piece("system", instructions)
    value = body.get("input")
    if isinstance(value, str):
        if not value and not body.get("previous_response_id"):
            raise BadRequest("'input' must not be empty", param="input")
        return text + _piece("user", value)
    if isinstance(value, list):
        return text + "".join(_responses_item(item, i) for i, item in enumerate(value))
    if value is None and body.get("previous_response_id"):
        return text
    raise BadRequest("'input' is required and must be a string or an array of items", param="input")


# ---- Anthropic Messages ----------------------------------------------------------------


def _messages_prompt(body: dict[str, Any], *, needs_max_tokens: bool) -> str:
    if needs_max_tokens:
        max_tokens = body.get("max_tokens")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise BadRequest("'max_tokens' is required and must be a positive integer", param="max_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' is required and must be a non-empty array", param="messages")
    text = _tools(body)
    system = body.get("system")
    if system is not None:
        if not isinstance(system, str | list):
            raise BadRequest("'system' must be a string or an array of text blocks", param="system")
        text += _piece("system", _content(system, "system"))
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise BadRequest(f"{where} must be an object", param="messages")
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise BadRequest(f"{where}.role must be 'user' or 'assistant'", param="messages")
        if "content" not in message:
            raise BadRequest(f"{where}.content is required", param="messages")
        text += _piece(role, _content(message["content"], f"{where}.content"))
    return text


# ---- pooling and tokenizer APIs ------------------------------------------------------------


def _texts(value: Any, field: str) -> str:
    if isinstance(value, dict):  # multimodal items: a stable text for the prefix
        return _json(value)
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return _MSG_SEP.join(_json(v) for v in value)
    return text_or_tokens(value, field)


def _pooling_prompt(api: ApiKind, body: dict[str, Any]) -> str:
    if api is ApiKind.RERANK:
        if not isinstance(body.get("query"), str):
            raise BadRequest("'query' is required and must be a string", param="query")
        return body["query"] + _MSG_SEP + _texts(body.get("documents"), "documents")
    if api is ApiKind.SCORE:
        first, second = ("text_1", "text_2") if "queries" not in body else ("queries", "documents")
        if "queries" in body and "documents" not in body:
            second = "items"
        return _texts(body.get(first), first) + _MSG_SEP + _texts(body.get(second), second)
    if api is ApiKind.DETOKENIZE:
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not tokens or any(isinstance(t, str | list) for t in tokens):
            message = "'tokens' is required and must be a non-empty array of token ids"
            raise BadRequest(message, param="tokens")
        return text_or_tokens(tokens, "tokens")
    if "messages" in body and api in (ApiKind.TOKENIZE, ApiKind.POOLING, ApiKind.CLASSIFY):
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty array", param="messages")
        return canonical_chat_prompt(messages)
    if api is ApiKind.TOKENIZE:  # vLLM's /tokenize takes text only (a dict was passed on as "items")
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise BadRequest("'prompt' is required and must be a non-empty string", param="prompt")
        return prompt
    return _texts(body.get("input"), "input")


def api_prompt(api: ApiKind, body: dict[str, Any]) -> str:
    """The canonical prompt text of a request to one of this module's APIs (raises BadRequest)."""
    if api is ApiKind.RESPONSES:
        return _responses_prompt(body)
    if api is ApiKind.MESSAGES:
        return _messages_prompt(body, needs_max_tokens=True)
    if api is ApiKind.COUNT_TOKENS:
        return _messages_prompt(body, needs_max_tokens=False)
    if api in FORM_APIS:  # the audio is no prompt text; the optional text prompt is
        prompt = body.get("prompt")
        return prompt if isinstance(prompt, str) else ""
    return _pooling_prompt(api, body)
