"""Whether a chat template takes message content as a string or as OpenAI parts.

vLLM decides it from the template's AST (``_detect_content_format`` in
``vllm/renderers/hf.py``, Apache-2.0, ported here): a template that loops over a
message's ``content`` (directly, through an alias, or through a macro parameter) gets
``[{"type": "text", "text": ...}]`` parts, any other gets the parts joined with ``"\\n"``.
The two render differently, so the local tokenizer must decide exactly as vLLM does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from functools import lru_cache

import jinja2.nodes

from gateway.prefix.chat_template import _ENV

__all__ = ["content_format"]

_Node = jinja2.nodes.Node


def _var(node: _Node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _attr(node: _Node, name: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return _var(node.node, name) and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
    if isinstance(node, jinja2.nodes.Getattr):
        return _var(node.node, name) and node.attr == key
    return False


def _access(node: _Node, name: str, key: str | None = None) -> bool:
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _access(node.node, name, key)
    if isinstance(node, jinja2.nodes.Test):
        return _access(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _access(node.node, name, key)
    return _attr(node, name, key) if key else _var(node, name)


def _aliases(root: _Node, name: str) -> Iterator[str]:
    yield name
    pending = deque([name])
    while pending:
        current = pending.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            if _access(assign.node, current) and isinstance(assign.target, jinja2.nodes.Name):
                yield assign.target.name
                if assign.target.name != current:
                    pending.append(assign.target.name)


def _message_names(root: _Node) -> list[str]:
    messages = list(_aliases(root, "messages"))
    out = []
    for loop in root.find_all(jinja2.nodes.For):
        if isinstance(loop.target, jinja2.nodes.Name) and any(_access(loop.iter, v) for v in messages):
            out.append(loop.target.name)
    return out


def _loops_over_content(root: _Node) -> bool:
    names = _message_names(root)
    params_by_loop: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        param_names = {arg.name for arg in macro.args}
        params: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(macro.args) and any(_access(arg, v, "content") for v in names):
                    params.add(macro.args[i].name)
            for kwarg in call.kwargs:
                if kwarg.key in param_names and any(_access(kwarg.value, v, "content") for v in names):
                    params.add(kwarg.key)
        for loop in macro.find_all(jinja2.nodes.For):
            in_macros.add(id(loop))
            if params:
                params_by_loop[id(loop)] = params
    for loop in root.find_all(jinja2.nodes.For):
        if any(_access(loop.iter, v, "content") for v in names):
            return True
        if isinstance(loop.iter, jinja2.nodes.Name):
            if loop.iter.name in params_by_loop.get(id(loop), ()):
                return True
            if id(loop) not in in_macros and loop.iter.name == "content":
                return True
    return False


@lru_cache(maxsize=32)
def content_format(source: str) -> str:
    """``"openai"`` or ``"string"`` (vLLM's default when the template does not parse)."""
    try:
        return "openai" if _loops_over_content(_ENV.parse(source)) else "string"
    except jinja2.TemplateError:
        return "string"
