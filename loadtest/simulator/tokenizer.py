"""Deterministic tokenizer approximation, or a real one.

Real tokenizers are not needed: what matters for routing is that equal text maps
to equal token ids and that conversations sharing leading messages share leading
tokens (through a fixed chat template), exactly as with a real chat template.

With ``LLMGW_SIM_TOKENIZER=DIR`` (or :func:`use`) prompts are tokenized with the model
directory's ``tokenizer.json`` and chat template instead, by the gateway's own renderer
(:mod:`gateway.prefix.local_tokenizer`), so a gateway tokenizing locally and the simulated
engine agree token for token (``loadtest.exact_bench --tokenizer``). Output tokens stay
the toy ones.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any

import xxhash

from gateway.prefix.chat_template import Unsupported
from gateway.prefix.local_tokenizer import LocalTokenizer

VOCAB_SIZE = 50_000
_TOKEN_RE = re.compile(r"<\|[a-z_]+\|>|\w+|[^\w\s]")

# Output vocabulary for generated text; every word is a single token.
WORDS: tuple[str, ...] = tuple(
    (
        "the of and to in is for that with on as are by this be from at or an it not have which "
        "model token cache prefix route replica batch decode prefill latency request stream queue "
        "block memory engine server client gateway fleet policy score weight load session value "
        "time step data layer head vector matrix graph node edge path result state event signal "
        "fast slow small large early late new old high low first last next open close short long "
        "river stone cloud light sound paper glass metal forest garden window market bridge tower"
    ).split()
)


@lru_cache(maxsize=65536)
def token_id(piece: str) -> int:
    """Stable id for one token string."""
    return xxhash.xxh32_intdigest(piece.encode()) % VOCAB_SIZE


_real: list[LocalTokenizer | None] = []  # [] until first use: LLMGW_SIM_TOKENIZER decides


def use(directory: str | None) -> None:
    """Tokenize with the real tokenizer in ``directory`` (None: the toy tokenizer)."""
    _real[:] = [LocalTokenizer(Path(directory), prefix_entries=0) if directory else None]  # full encodes


def real() -> LocalTokenizer | None:
    if not _real:
        use(os.environ.get("LLMGW_SIM_TOKENIZER") or None)
    return _real[0]


def real_chat_tokens(body: dict[str, Any]) -> list[int]:
    """A chat body's tokens as vLLM computes them (the real tokenizer must be in use)."""
    tok = real()
    assert tok is not None
    try:
        return tok.chat_tokens(body)
    except Unsupported as exc:
        raise ValueError(f"chat template: {exc}") from None


def tokenize(text: str) -> list[str]:
    return _TOKEN_RE.findall(text)


def encode(text: str) -> list[int]:
    """Text -> token ids (words, punctuation and chat-template specials)."""
    tok = real()
    if tok is not None:
        return tok.encode(text, add_special_tokens=True)  # a completion prompt, as vLLM encodes it
    return [token_id(p) for p in _TOKEN_RE.findall(text)]


def content_text(content: Any) -> str:
    """OpenAI message content (string or list of parts) -> plain text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict):
                if part.get("type", "text") == "text":
                    parts.append(str(part.get("text", "")))
                else:
                    raise ValueError(f"unsupported content part type {part.get('type')!r}")
            else:
                raise ValueError("content parts must be objects")
        return "\n".join(parts)
    raise ValueError("message content must be a string or a list of parts")


def render_chat(messages: Iterable[Any]) -> str:
    """Apply the fixed chat template and append the assistant generation header."""
    out: list[str] = []
    for msg in messages:
        if not isinstance(msg, dict):
            raise ValueError("each message must be an object")
        role = msg.get("role")
        if not isinstance(role, str):
            raise ValueError("message role must be a string")
        out.append(f"<|start|>{role}\n{content_text(msg.get('content'))}<|end|>\n")
    out.append("<|start|>assistant\n")
    return "".join(out)


def encode_chat(messages: Iterable[Any]) -> list[int]:
    if real() is not None:
        return real_chat_tokens({"messages": list(messages)})
    return encode(render_chat(messages))


def output_word(seed: int, index: int) -> str:
    """Deterministic pseudo-word number `index` of a response seeded by `seed`."""
    return WORDS[xxhash.xxh32_intdigest(index.to_bytes(8, "little"), seed=seed & 0xFFFFFFFF) % len(WORDS)]
