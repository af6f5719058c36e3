"""OpenAI request body → :class:`InferenceRequest`, parsed and validated exactly once.

The canonical prompt text serialises each chat message's role and content in order,
so turn N+1 of a conversation extends turn N's text exactly; the prefix index
hashes it. The raw body is kept and forwarded byte for byte.

Hostile bodies are refused here with a 400, never a 500: invalid UTF-8, nesting
deeper than ``max_json_depth`` (checked on the raw bytes *before* ``json.loads``, so
the recursive C decoder never sees it), non-finite or out-of-range numbers, and
known fields of the wrong type or range (``param`` names the field).
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.errors import BadRequest
from gateway.types import ApiKind, InferenceRequest

__all__ = [
    "DEFAULT_OPTIONS",
    "FIELD_RULES",
    "INT32_MAX",
    "INT_MAX",
    "INT_MIN",
    "NUMBER_MAX",
    "PRIORITIES",
    "FieldRule",
    "ParseOptions",
    "canonical_chat_prompt",
    "nesting_exceeds",
    "parse_request",
]

PRIORITIES = ("critical", "standard", "sheddable")
# Separators that cannot appear in JSON-decoded text by accident in a way that
# matters: they only need to make (role, content) boundaries unambiguous.
_ROLE_SEP = "\x1e"
_MSG_SEP = "\x1f"
CHARS_PER_TOKEN = 4  # rough estimate, good enough for load accounting

INT_MIN, INT_MAX = -(2**63), 2**64 - 1  # int64 .. uint64: every integer an OpenAI field can hold
# Every number in a body must fit an IEEE double, as for the engines' own JSON parsers: a
# literal past it (``1e400``, or 10**400 written out) is refused, never turned into inf.
NUMBER_MAX = sys.float_info.max
_NUMBER_MAX_INT = int(NUMBER_MAX)
INT32_MAX = 2**31 - 1  # no context window is longer; engines keep counts in 32 bits
_MAX_INT_DIGITS = len(str(_NUMBER_MAX_INT))  # longer literals are out of range; checked before int()
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
_LONG_DIGIT_RUN = b"0" * _MAX_INT_DIGITS


# ---- raw-body guards ------------------------------------------------------------------

# A JSON string literal. The tail ``(?:"|\\?\Z)`` lets an unterminated string match up
# to the end on the first try: no start position ever fails, so the scan stays linear
# even on ``"\"\"\"…`` (a plain ``"…"`` pattern goes quadratic there).
_STRING_LITERAL = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
_OPENERS_TO_SQUARE = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def nesting_exceeds(raw: bytes, limit: int) -> bool:
    """True if arrays/objects in ``raw`` nest deeper than ``limit`` levels (``{}`` is 1).

    Runs without recursion, only C-speed bytes operations: drop string literals (one
    linear regex pass), keep only the brackets, then peel the innermost ``[]`` pairs up
    to ``limit`` times; a pair that survives was nested deeper. After ``p`` peels every
    remaining container holds ``p`` more levels, so a run of ``limit + 1 - p`` openers
    proves the answer at once (this ends ``[[[[…`` bombs before the first peel). Exact
    for valid JSON; for invalid JSON it only keeps ``json.loads`` from recursing deeply.
    Worst case ``limit`` passes over the body, well below what ``json.loads`` spends on
    the same bytes.
    """
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False  # the common case: too few brackets to be too deep
    skeleton = _STRING_LITERAL.sub(b"", raw).translate(_OPENERS_TO_SQUARE, _NOT_BRACKETS)
    for peeled_levels in range(limit):
        if b"[" * (limit + 1 - peeled_levels) in skeleton:
            return True
        peeled = skeleton.replace(b"[]", b"")
        if len(peeled) == len(skeleton):
            return False  # nothing left to peel (unbalanced input is json.loads's to report)
        skeleton = peeled
    return b"[]" in skeleton


class _BadNumber:
    """Stands in for a refused number literal, so the error can name the field that held it."""

    __slots__ = ("literal",)

    def __init__(self, literal: str) -> None:
        self.literal = literal

    def describe(self) -> str:
        literal = self.literal
        shown = literal if len(literal) <= 24 else f"{literal[:12]}…({len(literal)} characters)"
        if literal in ("NaN", "Infinity", "-Infinity"):
            return f"{shown} is not valid JSON"
        return f"number {shown} is out of range"


class _NumberGuard:
    """``json.loads`` hooks: numbers past the double range (``1e400``, ``10**400``) and
    ``NaN``/``Infinity`` become :class:`_BadNumber`; the first one is remembered."""

    __slots__ = ("first",)

    def __init__(self) -> None:
        self.first: _BadNumber | None = None

    def integer(self, literal: str) -> int | _BadNumber:
        # The length check comes first: it keeps int() clear of the 4300-digit conversion limit.
        if len(literal) - literal.startswith("-") <= _MAX_INT_DIGITS:
            value = int(literal)
            if -_NUMBER_MAX_INT <= value <= _NUMBER_MAX_INT:
                return value
        return self.refuse(literal)

    def real(self, literal: str) -> float | _BadNumber:
        value = float(literal)
        return value if math.isfinite(value) else self.refuse(literal)  # 1e400 overflows to inf

    def refuse(self, literal: str) -> _BadNumber:
        bad = _BadNumber(literal)
        if self.first is None:
            self.first = bad
        return bad

    def check_fields(self, body: dict[str, Any]) -> None:
        """Name the top-level field holding a refused number (nested ones fail their own checks)."""
        if self.first is None:
            return
        for name, value in body.items():
            if isinstance(value, _BadNumber):
                raise BadRequest(f"'{name}': {value.describe()}", param=name, code="number_out_of_range")

    def check_all(self) -> None:
        """Refuse the body if a refused number sits anywhere no field check looked."""
        if self.first is not None:
            raise BadRequest(self.first.describe(), code="number_out_of_range")


def _load_object(raw_body: bytes, max_depth: int) -> tuple[dict[str, Any], _NumberGuard]:
    try:
        text = raw_body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"request body is not valid UTF-8 (byte {exc.start})") from None
    if nesting_exceeds(raw_body, max_depth):
        raise BadRequest(f"request body nests deeper than {max_depth} levels", code="json_too_deep")
    guard = _NumberGuard()
    # Without a digit run as long as the double range, no integer literal can leave it: skip
    # the per-integer hook then (it costs ~0.3 µs an integer, e.g. for token-id prompts).
    long_digits = _LONG_DIGIT_RUN in raw_body.translate(_DIGITS_AS_ZERO)
    try:
        body = json.loads(
            text,
            parse_int=guard.integer if long_digits else None,
            parse_float=guard.real,
            parse_constant=guard.refuse,
        )
    except json.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # only reachable with malformed input the scan let through
        raise BadRequest(f"request body nests deeper than {max_depth} levels", code="json_too_deep") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    guard.check_fields(body)
    return body, guard


# ---- known fields: types and ranges the engines would reject anyway --------------------


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_integer(value: Any) -> bool:
    """JSON has one number type: ``5.0`` is the integer 5 (as in JSON Schema and pydantic's lax mode)."""
    if isinstance(value, float):
        return value.is_integer()
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class FieldRule:
    """Type and range of one optional body field; ``null`` always passes (as in the OpenAI API).

    Declarative so that :mod:`gateway.openapi` documents exactly what is enforced.
    ``kind``: integer | number | boolean | string | object | array | stop (a string or
    an array of strings) | string-or-object | enum.
    """

    kind: str
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    choices: tuple[str, ...] = ()

    def accepts(self, value: Any) -> bool:
        if self.kind in ("integer", "number"):
            if not (_is_integer(value) if self.kind == "integer" else _is_number(value)):
                return False
            low, high = self.minimum, self.maximum
            if low is not None and (value <= low if self.exclusive_minimum else value < low):
                return False
            return high is None or value <= high
        if self.kind == "stop":
            return isinstance(value, str) or (
                isinstance(value, list) and all(isinstance(s, str) for s in value)
            )
        if self.kind == "enum":
            return value in self.choices
        return isinstance(value, _PY_TYPES[self.kind])

    def expected(self) -> str:
        if self.kind in ("integer", "number"):
            bounds = []
            if self.minimum is not None:
                bounds.append(f"{'>' if self.exclusive_minimum else '>='} {self.minimum}")
            if self.maximum is not None:
                bounds.append(f"<= {self.maximum}")
            article = "an integer" if self.kind == "integer" else "a number"
            return f"{article} {' and '.join(bounds)}".rstrip()
        if self.kind == "enum":
            return "one of " + ", ".join(repr(c) for c in self.choices)
        return _EXPECTED[self.kind]


_PY_TYPES: dict[str, type | tuple[type, ...]] = {
    "boolean": bool,
    "string": str,
    "object": dict,
    "array": list,
    "string-or-object": (str, dict),
}
_EXPECTED = {
    "boolean": "a boolean",
    "string": "a string",
    "object": "an object",
    "array": "an array",
    "stop": "a string or an array of strings",
    "string-or-object": "a string or an object",
}


def _int(low: int = INT_MIN, high: int = INT_MAX) -> FieldRule:
    return FieldRule("integer", low, high)


def _count(low: int) -> FieldRule:
    return FieldRule("integer", low, INT32_MAX)


_SAMPLING: dict[str, FieldRule] = {
    "n": _count(1),
    "temperature": FieldRule("number", 0),
    "top_p": FieldRule("number", 0, 1),
    "top_k": _count(-1),
    "min_p": FieldRule("number", 0, 1),
    "presence_penalty": FieldRule("number", -2, 2),
    "frequency_penalty": FieldRule("number", -2, 2),
    "repetition_penalty": FieldRule("number", 0, exclusive_minimum=True),
    "seed": _int(),
    "stop": FieldRule("stop"),
    "stream_options": FieldRule("object"),
    "logit_bias": FieldRule("object"),
    "priority": _int(),  # vLLM / SGLang priority scheduling
}
FIELD_RULES: dict[ApiKind, dict[str, FieldRule]] = {
    ApiKind.CHAT: {
        **_SAMPLING,
        "max_tokens": _count(1),
        "max_completion_tokens": _count(1),
        "logprobs": FieldRule("boolean"),
        "top_logprobs": _count(0),
        "tools": FieldRule("array"),
        "tool_choice": FieldRule("string-or-object"),
        "parallel_tool_calls": FieldRule("boolean"),
        "response_format": FieldRule("object"),
    },
    ApiKind.COMPLETIONS: {
        **_SAMPLING,
        "max_tokens": _count(0),  # 0 with echo: prompt logprobs only (vLLM scoring)
        "best_of": _count(1),
        "logprobs": _count(0),
        "echo": FieldRule("boolean"),
        "suffix": FieldRule("string"),
    },
    ApiKind.EMBEDDINGS: {
        "encoding_format": FieldRule("enum", choices=("float", "base64")),
        "dimensions": _count(1),
        "priority": _int(),
    },
}


def _check_fields(api: ApiKind, body: dict[str, Any]) -> None:
    for name, rule in FIELD_RULES[api].items():
        value = body.get(name)
        if value is not None and not rule.accepts(value):
            raise BadRequest(f"'{name}' must be {rule.expected()}, got {_describe(value)}", param=name)


def _describe(value: Any) -> str:
    if isinstance(value, bool | int | float):
        text = json.dumps(value)
        return text if len(text) <= 24 else f"a {len(text)}-digit number"
    return {str: "a string", list: "an array", dict: "an object"}.get(type(value), "null")


# ---- prompts -----------------------------------------------------------------------------


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


def _refused_number_text(value: Any) -> str:
    """json.dumps fallback for a refused number; the request is refused before the text is used."""
    if isinstance(value, _BadNumber):
        return value.literal
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


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
                tool_calls, sort_keys=True, separators=(",", ":"), default=_refused_number_text
            )
        pieces.append(role + _ROLE_SEP + text + _MSG_SEP)
    return "".join(pieces)


def _token_ids(value: Any) -> bool:
    if not isinstance(value, list) or not value:
        return False
    if all(type(t) is int for t in value):  # the common case, at C speed (bools are not ints here)
        return INT_MIN <= min(value) and max(value) <= INT_MAX
    return all(_is_integer(t) and INT_MIN <= t <= INT_MAX for t in value)


def _token_text(ids: list[int | float]) -> str:
    """Token ids hash as their decimal text (5.0 as 5)."""
    return " ".join(map(str, ids)) if all(type(t) is int for t in ids) else " ".join(str(int(t)) for t in ids)


def _text_or_tokens(value: Any, field: str) -> str:
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


# ---- the request -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ParseOptions:
    """Where session, priority and tenant come from (configurable names), and the depth limit."""

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
    body, numbers = _load_object(raw_body, options.max_json_depth)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a non-empty string", param="model")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    stream = bool(stream)
    _check_fields(api, body)

    if api is ApiKind.CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' is required and must be a non-empty array", param="messages")
        prompt = canonical_chat_prompt(messages)
    elif api is ApiKind.COMPLETIONS:
        if "prompt" not in body:
            raise BadRequest("'prompt' is required", param="prompt")
        prompt = _text_or_tokens(body["prompt"], "prompt")
    else:
        prompt = _text_or_tokens(body.get("input"), "input")
        stream = False

    priority_header = options.priority_header
    priority = headers.get(priority_header, "standard").strip().lower() or "standard"
    if priority not in PRIORITIES:
        raise BadRequest(
            f"header {priority_header}: {priority!r} is not one of {list(PRIORITIES)}", param=priority_header
        )
    numbers.check_all()
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
