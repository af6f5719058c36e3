"""A chat request's prompt text, rendered the way vLLM 0.32 renders it (transformers 5's template).

Exact prefix matching needs the engine's tokens, so the local tokenizer must see the very
text the engine's chat template produces. What vLLM does, step by step, and mirrored here:

- messages → its "conversation" (``parse_chat_messages``): only ``role``, ``content``,
  ``name``, ``task``, an assistant's ``tool_calls`` (arguments parsed to objects) and
  ``reasoning``, a tool's ``tool_call_id``, a developer's ``tools``; text parts joined with
  ``"\\n"`` when the template takes string content, kept as ``{"type": "text", ...}`` parts
  when it iterates over content (``content_format``, :mod:`.template_format`);
- template kwargs: ``merge_kwargs`` drops ``None`` and ``"auto"`` values; the template sees
  the tokenizer's named special tokens (``bos_token``…), ``messages``, ``tools``,
  ``documents``, ``add_generation_prompt`` and the request's kwargs it declares;
- jinja2 ``ImmutableSandboxedEnvironment(trim_blocks, lstrip_blocks)``, ``loopcontrols``,
  transformers' ``tojson`` (no HTML escaping), ``raise_exception``, ``strftime_now``;
- ``continue_final_message``: the final message rendered with a tag, the text cut there.

Anything else (media parts, unknown part fields, a request-supplied template, harmony or
Mistral formats) raises :class:`Unsupported`: the caller falls back to the engine.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox

__all__ = ["Unsupported", "compile_template", "conversation", "render", "template_variables"]

_TEXT_TYPES = frozenset({"text"})  # vLLM also takes input_text/output_text/refusal/thinking: rare, not here
_BILLING_HEADER = "x-anthropic-billing-header"  # vLLM strips this line from system text
# transformers' apply_chat_template consumes these itself; the template never sees them as kwargs
_NAMED_PARAMS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})  # fmt: skip
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class Unsupported(Exception):
    """The local path cannot reproduce the engine here; ``reason`` is the metric label."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class _Generation(jinja2.ext.Extension):
    """``{% generation %}`` as transformers parses it (the assistant-mask marker; a no-op here)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_support"), [], [], body).set_lineno(lineno)

    def _support(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()


@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """Compiled once per template text; a syntax error is :class:`Unsupported` (``template``)."""
    try:
        return _ENV.from_string(source)
    except jinja2.TemplateError as exc:
        raise Unsupported("template", str(exc)) from None


@lru_cache(maxsize=32)
def template_variables(source: str) -> frozenset[str]:
    return frozenset(jinja2.meta.find_undeclared_variables(_ENV.parse(source)))


def _texts(content: Any, role: str) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        parts: list[Any] = [content]
    elif isinstance(content, list):
        parts = content
    else:
        raise Unsupported("content", type(content).__name__)
    texts = []
    for part in parts:
        if isinstance(part, dict):
            if part.get("type") not in _TEXT_TYPES or set(part) - {"type", "text"}:
                raise Unsupported("content_part")
            text = part.get("text")
            if text is None:
                continue  # vLLM skips a text part without text
            if not isinstance(text, str):
                raise Unsupported("content_part")
        elif isinstance(part, str):
            text = part
        else:
            raise Unsupported("content_part")
        if role == "system" and text.startswith(_BILLING_HEADER):
            text = text.partition("\n")[2]
            if not text:
                continue
        texts.append(text)
    return texts


def _arguments(value: Any) -> dict[str, Any]:
    """vLLM's ``_postprocess_messages``: tool-call arguments as an object ({} when not one)."""
    if not value:
        return {}
    if isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return {}
    return value if isinstance(value, dict) else {}


def _tool_calls(calls: Any) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise Unsupported("tool_calls")
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise Unsupported("tool_calls")  # vLLM answers 400
        out.append({**call, "function": {**function, "arguments": _arguments(function.get("arguments"))}})
    return out


def conversation(messages: list[Any], content_format: str) -> list[dict[str, Any]]:
    """vLLM's conversation for ``messages`` (text only), as its template receives it."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise Unsupported("message")
        role = message["role"]
        texts = _texts(message.get("content"), role)
        item: dict[str, Any] = {"role": role}
        if content_format == "openai":
            item["content"] = [{"type": "text", "text": t} for t in texts]
        else:
            item["content"] = "\n".join(texts)
        if role == "assistant":
            if message.get("tool_calls") is not None:
                calls = _tool_calls(message["tool_calls"])
                if calls:  # an empty list is dropped: the template takes the plain path
                    item["tool_calls"] = calls
            if message.get("reasoning") is not None:
                item["reasoning"] = item["reasoning_content"] = message["reasoning"]
        elif role == "tool":
            if "tool_call_id" in message:
                item["tool_call_id"] = message["tool_call_id"]
            if isinstance(item["content"], list):
                item["content"] = "\n".join(texts)
        for key in ("name", "task"):
            if isinstance(message.get(key), str):
                item[key] = message[key]
        if role == "developer":
            item["tools"] = message.get("tools")
        out.append(item)
    return out


def _developer_as_system(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM: developer → system (and all system messages merged first) for templates without it."""
    converted = []
    for message in chat:
        if message["role"] == "developer":
            message = {k: v for k, v in message.items() if k != "tools"} | {"role": "system"}
        converted.append(message)
    systems, rest, merge = [], [], False
    for i, message in enumerate(converted):
        if message["role"] != "system":
            rest.append(message)
            continue
        merge = merge or i > 0 or bool(systems)
        content = message.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] for p in content if isinstance(p, dict) and "text" in p)
        if content:
            systems.append(content)
    return [{"role": "system", "content": "\n\n".join(systems)}, *rest] if merge else converted


def render(
    source: str,
    chat: list[dict[str, Any]],
    *,
    special_tokens: Mapping[str, str],
    kwargs: Mapping[str, Any],
    tools: list[dict[str, Any]] | None,
) -> str:
    """The prompt text. ``kwargs`` as vLLM passes them (add_generation_prompt,
    continue_final_message, documents, the request's chat_template_kwargs)."""
    template = compile_template(source)
    if any(m["role"] == "developer" for m in chat) and not (
        '"developer"' in source or "'developer'" in source
    ):
        chat = _developer_as_system(chat)
    declared = template_variables(source)
    context: dict[str, Any] = dict(special_tokens)
    context.update((k, v) for k, v in kwargs.items() if k in declared and k not in _NAMED_PARAMS)
    add_generation_prompt = bool(kwargs.get("add_generation_prompt", False))
    continue_final = kwargs.get("continue_final_message", False)
    final = None
    if continue_final:
        if add_generation_prompt:
            raise Unsupported("continue_final_message")  # vLLM answers 400
        if not isinstance(continue_final, bool) or not chat or "content" not in source:
            raise Unsupported("continue_final_message")
        final = chat[-1].get("content")
        last = dict(chat[-1])
        if isinstance(final, list):
            texts = [p for p in final if isinstance(p, dict) and "text" in p]
            if not texts:
                raise Unsupported("continue_final_message")
            final = texts[-1]["text"]
            parts = list(last["content"])
            index = max(i for i, p in enumerate(parts) if isinstance(p, dict) and "text" in p)
            parts[index] = {**parts[index], "text": final + _CONTINUE_TAG}
            last["content"] = parts
        elif isinstance(final, str):
            last["content"] = final + _CONTINUE_TAG
        else:
            raise Unsupported("continue_final_message")
        chat = [*chat[:-1], last]
    try:
        text = template.render(
            messages=chat,
            tools=tools,
            documents=kwargs.get("documents"),
            add_generation_prompt=add_generation_prompt,
            **context,
        )
    except jinja2.TemplateError as exc:  # raise_exception(): the engine refuses the request too
        raise Unsupported("template_error", str(exc)) from None
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, RecursionError) as exc:
        raise Unsupported("template_error", repr(exc)) from None
    if final is not None:
        if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
            raise Unsupported("continue_final_message")
        at = text.rindex(_CONTINUE_TAG.strip())
        text = text[:at] if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
    return text
