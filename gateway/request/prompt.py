"""Prompt canonicalisation: the text the prefix index hashes, per API.

Chat messages serialise role and content in order with separators that JSON-decoded
text cannot blur, so turn N+1 of a conversation extends turn N's text exactly.
Completions and embeddings take a string, strings, token ids or lists of token ids.
"""

from __future__ import annotations

import json
from typing import Any

import xxhash

from gateway.errors import BadRequest
from gateway.request.fields import INT_MAX, INT_MIN, is_integer
from gateway.request.guards import refused_number_text

__all__ = ["NOT_PROMPT", "canonical_chat_prompt", "media_placeholder", "text_or_tokens"]

# Separators that cannot appear in JSON-decoded text by accident in a way that
# matters: they only need to make (role, content) boundaries unambiguous.
_ROLE_SEP = "\x1e"
_MSG_SEP = "\x1f"


# Block fields that say nothing about the prompt's text (Anthropic moves its cache
# breakpoints every turn; ids are the client's bookkeeping).
NOT_PROMPT = frozenset({"cache_control", "id", "status", "citations"})


def media_placeholder(part: dict[str, Any]) -> str:
    """An image, audio clip or file in the prompt text: its type and a digest of the part (its
    URL or data; not the fields of ``NOT_PROMPT``). Equal parts hash alike, so a conversation's
    prefix stays aligned; a new image starts a new prefix, as it does in the engine's cache (a
    bare ``<image_url>`` made every image the same: 30 requests with 30 images went to one
    replica, predicted cached)."""
    digest = xxhash.xxh3_64()
    _feed(digest, {k: v for k, v in part.items() if k not in NOT_PROMPT})
    return f"<{part['type']}:{digest.hexdigest()}>"


def _feed(digest: Any, value: Any) -> None:
    """``value`` into ``digest``, unambiguously, strings as their bytes (a 4 MB base64 image is
    hashed, not JSON-escaped first: json.dumps cost ~4.5 ms a MB)."""
    if isinstance(value, str):
        data = value.encode("utf-8", "surrogatepass")
        digest.update(b"s%d:" % len(data))
        digest.update(data)
    elif isinstance(value, dict):
        digest.update(b"d%d:" % len(value))
        for key in sorted(value, key=str):
            _feed(digest, str(key))
            _feed(digest, value[key])
    elif isinstance(value, list | tuple):
        digest.update(b"l%d:" % len(value))
        for item in value:
            _feed(digest, item)
    else:  # numbers, booleans, None: their JSON-ish text, typed
        digest.update(b"o" + repr(value).encode() + b";")


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
                parts.append(media_placeholder(part))
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
        name = message.get("name")
        if name is not None and not isinstance(name, str):
            raise BadRequest(f"messages[{index}].name must be a string", param=f"messages.{index}.name")
        text = _content_text(message.get("content"), index)
        tool_calls = message.get("tool_calls")
        if tool_calls is not None and not isinstance(tool_calls, list):
            raise BadRequest(
                f"messages[{index}].tool_calls must be an array", param=f"messages.{index}.tool_calls"
            )
        if tool_calls:
            text += "<tool_calls>" + json.dumps(
                tool_calls, sort_keys=True, separators=(",", ":"), default=refused_number_text
            )
        pieces.append(role + _ROLE_SEP + text + _MSG_SEP)
    return "".join(pieces)


def _token_ids(value: Any) -> bool:
    if not isinstance(value, list) or not value:
        return False
    if all(type(t) is int for t in value):  # the common case, at C speed (bools are not ints here)
        return INT_MIN <= min(value) and max(value) <= INT_MAX
    return all(is_integer(t) and INT_MIN <= t <= INT_MAX for t in value)


def _token_text(ids: list[int | float]) -> str:
    """Token ids hash as their decimal text (5.0 as 5)."""
    return " ".join(map(str, ids)) if all(type(t) is int for t in ids) else " ".join(str(int(t)) for t in ids)


def text_or_tokens(value: Any, field: str) -> str:
    """A string, or a non-empty list of strings, of token ids, or of token-id lists."""
    if isinstance(value, str):
        if not value:
            raise BadRequest(f"'{field}' must not be empty", param=field)
        return value
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return _MSG_SEP.join(value)
        if _token_ids(value):
            return _token_text(value)
        if all(_token_ids(p) for p in value):
            return _MSG_SEP.join(_token_text(p) for p in value)
    raise BadRequest(
        f"'{field}' must be a non-empty string, list of strings, or list of token ids", param=field
    )
