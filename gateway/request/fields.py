"""Types and ranges of the known body fields, per API — the values the engines would reject anyway.

Declarative, so that :mod:`gateway.http.openapi` documents exactly what is enforced.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

from gateway.errors import BadRequest
from gateway.request.types import ApiKind

__all__ = [
    "FIELD_RULES",
    "INT32_MAX",
    "INT_MAX",
    "INT_MIN",
    "NUMBER_MAX",
    "FieldRule",
    "check_fields",
    "is_integer",
]

INT_MIN, INT_MAX = -(2**63), 2**64 - 1  # int64 .. uint64: every integer an OpenAI field can hold
# Every number in a body must fit an IEEE double, as for the engines' own JSON parsers: a
# literal past it (``1e400``, or 10**400 written out) is refused, never turned into inf.
NUMBER_MAX = sys.float_info.max
INT32_MAX = 2**31 - 1  # no context window is longer; engines keep counts in 32 bits


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_integer(value: Any) -> bool:
    """JSON has one number type: ``5.0`` is the integer 5 (as in JSON Schema and pydantic's lax mode)."""
    if isinstance(value, float):
        return value.is_integer()
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class FieldRule:
    """Type and range of one optional body field; ``null`` always passes (as in the OpenAI API).

    Declarative so that :mod:`gateway.http.openapi` documents exactly what is enforced.
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
            if not (is_integer(value) if self.kind == "integer" else _is_number(value)):
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
    ApiKind.RESPONSES: {
        "temperature": FieldRule("number", 0),
        "top_p": FieldRule("number", 0, 1),
        "max_output_tokens": _count(1),
        "instructions": FieldRule("string"),
        "previous_response_id": FieldRule("string"),
        "store": FieldRule("boolean"),
        "background": FieldRule("boolean"),
        "tools": FieldRule("array"),
        "tool_choice": FieldRule("string-or-object"),
        "parallel_tool_calls": FieldRule("boolean"),
        "metadata": FieldRule("object"),
        "text": FieldRule("object"),
        "reasoning": FieldRule("object"),
        "include": FieldRule("array"),
        "prompt_cache_key": FieldRule("string"),
        "priority": _int(),
    },
    ApiKind.MESSAGES: {
        "temperature": FieldRule("number", 0, 1),
        "top_p": FieldRule("number", 0, 1),
        "top_k": _count(0),
        "stop_sequences": FieldRule("array"),
        "tools": FieldRule("array"),
        "tool_choice": FieldRule("object"),
        "metadata": FieldRule("object"),
        "thinking": FieldRule("object"),
    },
    ApiKind.COUNT_TOKENS: {
        "tools": FieldRule("array"),
        "tool_choice": FieldRule("object"),
        "thinking": FieldRule("object"),
    },
    ApiKind.RERANK: {"top_n": _count(0), "return_documents": FieldRule("boolean"), "priority": _int()},
    ApiKind.SCORE: {"priority": _int()},
    ApiKind.CLASSIFY: {"priority": _int()},
    ApiKind.POOLING: {"priority": _int()},
    ApiKind.TOKENIZE: {"add_special_tokens": FieldRule("boolean"), "return_token_strs": FieldRule("boolean")},
    ApiKind.DETOKENIZE: {},
}


def check_fields(api: ApiKind, body: dict[str, Any]) -> None:
    """Each typed field the body has (a chat body names a few of its API's ~25 rules); with
    several wrong, the error names the first in the rules' order, whatever the body's order."""
    rules = FIELD_RULES.get(api)
    if not rules:
        return
    wrong = [
        name
        for name, value in body.items()
        if value is not None and (rule := rules.get(name)) is not None and not rule.accepts(value)
    ]
    if wrong:
        order = list(rules)
        name = min(wrong, key=order.index)
        value = body[name]
        raise BadRequest(f"'{name}' must be {rules[name].expected()}, got {_describe(value)}", param=name)


def _describe(value: Any) -> str:
    if isinstance(value, bool | int | float):
        text = json.dumps(value)
        return text if len(text) <= 24 else f"a {len(text)}-digit number"
    names: dict[type, str] = {str: "a string", list: "an array", dict: "an object"}
    return names.get(type(value), "null")
