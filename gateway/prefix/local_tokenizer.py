"""The engine's prompt tokens computed in the gateway: ``tokenizer.json`` + the chat template.

Why: the ``/tokenize`` round trip to a replica (16–38 ms on a loaded host) is on every
exact-routed request's critical path; the same tokens cost a millisecond or two locally.
Files come from a configured directory or the local Hugging Face cache
(``HF_HUB_CACHE``, ``HF_HOME/hub``, ``~/.cache/huggingface/hub``) and are never
downloaded. Loaded as transformers 5 loads them for vLLM 0.32: the named special tokens
(``bos_token``…, also from ``special_tokens_map.json``) added when missing, the
post-processor of ``tokenizer.json`` as it is (transformers ignores the config's
``add_bos_token``/``add_eos_token`` when there is a ``tokenizer.json``),
``split_special_tokens``, no truncation or padding. Chat prompts are encoded without
special tokens (vLLM's chat default), completion prompts with them.

:meth:`LocalTokenizer.prepare` (render, find a cached cut: tens of microseconds) runs on the
event loop, :meth:`LocalTokenizer.finish` (the encoding) in a small thread pool when there
is much to encode (``tokenizers`` releases the GIL while encoding; :mod:`.local_tokens`).
What cannot be reproduced raises :class:`~gateway.prefix.chat_template.Unsupported`.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from gateway.prefix.chat_template import Unsupported, conversation, render
from gateway.prefix.prefix_tokens import Plan, PrefixTokens, first_message_end
from gateway.prefix.template_format import content_format

__all__ = ["LocalTokenizer", "Prepared", "find_tokenizer_dir", "hf_cache_dirs", "is_tokenizer_dir"]

log = logging.getLogger(__name__)

_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# chat fields that vLLM takes but the local path cannot reproduce: the engine answers them
_ENGINE_ONLY = (
    "chat_template",
    "cache_salt",
    "truncate_prompt_tokens",
    "mm_processor_kwargs",
    "media_io_kwargs",
)
_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "chat_template.json")


def is_tokenizer_dir(path: Path) -> bool:
    return (path / "tokenizer.json").is_file()


def hf_cache_dirs() -> list[Path]:
    """Where a Hugging Face hub cache may be, in huggingface_hub's order."""
    out = []
    if os.environ.get("HF_HUB_CACHE"):
        out.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        out.append(Path(os.environ["HF_HOME"]) / "hub")
    out.append(Path.home() / ".cache" / "huggingface" / "hub")
    return out


def _snapshot(repo_dir: Path) -> Path | None:
    """The snapshot ``refs/main`` names, else the newest one holding a tokenizer."""
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        snap = repo_dir / "snapshots" / ref.read_text().strip()
        if is_tokenizer_dir(snap):
            return snap
    snaps = [p for p in (repo_dir / "snapshots").glob("*") if is_tokenizer_dir(p)]
    return max(snaps, key=lambda p: p.stat().st_mtime) if snaps else None


def find_tokenizer_dir(
    model: str, *, models: dict[str, str], path: str | None, hf_cache: bool
) -> Path | None:
    """The directory of ``model``'s tokenizer: configured per model, the shared ``path``, the
    served name itself when it is a local directory (``vllm serve /models/x``), the HF cache."""
    if model in models:
        return Path(models[model])
    if path is not None:
        return Path(path)
    if "/" in model or model.startswith("."):
        local = Path(model)
        if local.is_absolute() and is_tokenizer_dir(local):
            return local
    if hf_cache and "/" in model and ".." not in model:
        for cache in hf_cache_dirs():
            found = _snapshot(cache / ("models--" + model.replace("/", "--")))
            if found is not None:
                return found
    return None


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]  # an AddedToken as transformers saves it
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data


def _chat_template(directory: Path, config: dict[str, Any]) -> str | dict[str, str] | None:
    jinja = directory / "chat_template.jinja"  # transformers 5: the file wins over the config
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name", "template"}]
        return {t["name"]: t["template"] for t in template if isinstance(t, dict) and "name" in t}
    return template if isinstance(template, str) else None


class LocalTokenizer:
    """One model's tokenizer and chat template, as the engine loads them."""

    def __init__(self, directory: Path, prefix_entries: int = 1024) -> None:
        self.directory = directory
        self.tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self._encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        config = _read_json(directory / "tokenizer_config.json")
        special_map = _read_json(directory / "special_tokens_map.json")
        self.special_tokens: dict[str, str] = {}
        for attr in _SPECIAL:
            text = _token_text(config.get(attr, special_map.get(attr)))
            if text is not None:
                self.special_tokens[attr] = text
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        extras = [t for t in (_token_text(x) for x in extra) if t] if isinstance(extra, list) else []
        added = {t.content for t in self.tokenizer.get_added_tokens_decoder().values()}
        missing = [t for t in [*self.special_tokens.values(), *extras] if t not in added]
        if missing:
            self.tokenizer.add_special_tokens(
                [AddedToken(t, special=True, normalized=False) for t in missing]
            )
        if config.get("split_special_tokens"):
            self.tokenizer.encode_special_tokens = True
        self.template = _chat_template(directory, config)
        self.processor = any((directory / name).is_file() for name in _PROCESSOR_FILES)
        self.tokenizer_class = str(config.get("tokenizer_class", ""))
        self.prefix = PrefixTokens(self.tokenizer, prefix_entries)  # after the special tokens are added

    def _template_for(self, tools: Any) -> str:
        template = self.template
        if isinstance(template, dict):
            name = "tool_use" if tools is not None and "tool_use" in template else "default"
            template = template.get(name)
        if not isinstance(template, str):
            raise Unsupported("no_template")
        return template

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Ids only (no offsets: ~20 % cheaper); the batch call releases the GIL while it runs."""
        return self._encode([text], add_special_tokens=add_special_tokens)[0].ids

    def chat_text(self, body: dict[str, Any]) -> str:
        """The prompt text vLLM's ``/v1/chat/completions`` renders for ``body``."""
        if self.processor:
            raise Unsupported("processor")  # vLLM prefers a processor's template (multimodal models)
        if any(k in body and body[k] is not None for k in _ENGINE_ONLY):
            raise Unsupported("engine_only_field")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise Unsupported("message")
        tools = body.get("tools")
        if tools is not None and body.get("tool_choice") == "none":
            raise Unsupported("tool_choice_none")  # the server may drop the tools (a flag we cannot see)
        tool_dicts = _tools(tools) if tools is not None else None
        source = self._template_for(tool_dicts)
        user = body.get("chat_template_kwargs") or {}
        if not isinstance(user, dict) or {"chat_template", "tokenize"} & user.keys():
            raise Unsupported("chat_template_kwargs")  # vLLM answers 400
        # vLLM's merge_kwargs: the request's values win, None and "auto" are unset
        kwargs = {k: v for k, v in user.items() if v is not None and v != "auto"}
        extra = {
            "add_generation_prompt": body.get("add_generation_prompt", True),
            "continue_final_message": body.get("continue_final_message", False),
            "documents": body.get("documents"),
            "reasoning_effort": body.get("reasoning_effort"),
        }
        if body.get("reasoning_effort") is not None and "enable_thinking" not in user:
            extra["enable_thinking"] = body["reasoning_effort"] != "none"
        kwargs.update((k, v) for k, v in extra.items() if v is not None and v != "auto")
        chat = conversation(messages, content_format(source))
        return render(source, chat, special_tokens=self.special_tokens, kwargs=kwargs, tools=tool_dicts)

    def prepare(self, api: str, body: dict[str, Any]) -> Prepared:
        """The cheap part, fit for the event loop: the prompt text and where encoding starts."""
        if api != "chat":
            prompt = body.get("prompt")
            add_special = body.get("add_special_tokens", True)
            if not isinstance(prompt, str) or not isinstance(add_special, bool):
                raise Unsupported("prompt")
            if any(k in body and body[k] is not None for k in ("cache_salt", "truncate_prompt_tokens")):
                raise Unsupported("engine_only_field")
            return Prepared(prompt, add_special, None, None)
        add_special = body.get("add_special_tokens", False)
        if not isinstance(add_special, bool):
            raise Unsupported("add_special_tokens")
        text = self.chat_text(body)
        if add_special or not self.prefix.enabled:
            return Prepared(text, add_special, None, None)
        return Prepared(text, add_special, self.prefix.plan(text), first_message_end(text, body["messages"]))

    def finish(self, prepared: Prepared) -> list[int]:
        """The encoding itself (a next turn re-encodes only its new part)."""
        if prepared.plan is not None:
            return self.prefix.encode(prepared.text, prepared.plan, prepared.first_end)
        return self.encode(prepared.text, prepared.add_special)

    def chat_tokens(self, body: dict[str, Any]) -> list[int]:
        return self.finish(self.prepare("chat", body))

    def completion_tokens(self, body: dict[str, Any]) -> list[int]:
        return self.finish(self.prepare("completions", body))


@dataclass(frozen=True, slots=True)
class Prepared:
    text: str
    add_special: bool
    plan: Plan | None
    first_end: int | None  # where the first message ends in ``text``: its cut is kept too

    @property
    def remaining(self) -> int:
        """Characters left to encode."""
        return self.plan.remaining(self.text) if self.plan is not None else len(self.text)


def _tools(tools: Any) -> list[dict[str, Any]]:
    """vLLM's ``[tool.model_dump() for tool in request.tools]``: only the model's fields,
    ``description``/``parameters`` present (None when absent), ``strict``/``defer_loading`` when set."""
    if not isinstance(tools, list):
        raise Unsupported("tools")
    out = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(function, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("description"), str | None)
            or not isinstance(function.get("parameters"), dict | None)
        ):
            raise Unsupported("tools")
        defer = tool.get("defer_loading")
        fn: dict[str, Any] = {
            "name": function["name"],
            "description": function.get("description"),
            "parameters": function.get("parameters"),
        }
        for key in ("strict", "defer_loading"):
            value = function.get(key)
            if key == "defer_loading" and value is None:
                value = defer
            if value is not None:
                fn[key] = value
        item: dict[str, Any] = {"type": "function", "function": fn}
        if defer is not None:
            item["defer_loading"] = defer
        out.append(item)
    return out
