"""The previous turn's engine tokens as the known prefix of a conversation's next turn.

Turn N+1 of a chat is turn N's messages plus the assistant's answer and a new user
message. With a chat template that renders messages one after another (and whose
generation prompt is the assistant header), the engine's tokens for turn N are a prefix
of turn N+1's, so the blocks the engines hold for turn N+1 can be matched on turn N's
tokens without waiting for ``/tokenize``: the round trip leaves the critical path, and
the full tokens are fetched in the background (for the turn after, and to check).

Trusted per model only after the background answers confirmed the prefix
``_TRUST_AFTER`` times, and never again after one contradiction (a template that drops
earlier reasoning, rewrites history, …): those models keep the on-path ``/tokenize``.
What the shortcut cannot see are blocks past turn N's tokens — the engine's blocks of
its own answer, hit when the answer re-tokenizes to the tokens it generated — so a
prediction can be short by those blocks.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import xxhash

from gateway.prefix.token_cache import TokenCache
from gateway.request.types import InferenceRequest

__all__ = ["TurnTokens"]

log = logging.getLogger(__name__)

_TRUST_AFTER = 3
_ENCODE = msgspec.json.Encoder(order="sorted").encode


class TurnTokens:
    def __init__(self, entries: int, max_tokens: int = 16_000_000) -> None:
        self._entries = entries
        # conversation key (model, template options, messages) → (engine tokens, prompt chars)
        self._cache = TokenCache(entries, max_tokens)
        self._trust: dict[str, int] = {}  # model → confirmations so far; -1: never

    @property
    def tokens(self) -> int:
        """Tokens held (bounded like the engine-token cache: count alone allowed gigabytes)."""
        return self._cache.tokens

    @staticmethod
    def key(request: InferenceRequest, body: dict[str, Any], count: int) -> bytes:
        extras = {k: v for k, v in body.items() if k not in ("model", "messages")}
        hasher = xxhash.xxh3_128(f"{request.api}\x00{request.model}\x00".encode())
        hasher.update(_ENCODE(extras))
        hasher.update(_ENCODE(body["messages"][:count]))
        return hasher.digest()

    def trusted(self, model: str) -> bool:
        return self._trust.get(model, 0) >= _TRUST_AFTER

    def store(self, request: InferenceRequest, body: dict[str, Any], tokens: list[int]) -> None:
        if not self._entries or request.api != "chat":
            return
        self._cache.put(self.key(request, body, len(body["messages"])), tokens, len(request.prompt_text))

    def previous(self, request: InferenceRequest, body: dict[str, Any]) -> tuple[list[int], int] | None:
        """The latest earlier turn's tokens and their prompt's length in chars, if known."""
        if request.api != "chat":
            return None
        messages = body["messages"]
        # [..., assistant, new message]: the turn before ended where the assistant's answer
        # starts, i.e. with the generation prompt. Anything else (two user messages in a row,
        # an edited history) does not extend the previous request's tokens.
        count = len(messages) - 2
        if count < 1 or not isinstance(messages[count], dict) or messages[count].get("role") != "assistant":
            return None
        key = self.key(request, body, count)
        hit = self._cache.get(key)
        return None if hit is None else (hit[0].tolist(), hit[1])

    def verify(self, model: str, prefix: list[int], full: list[int]) -> bool:
        """Record whether ``prefix`` (an earlier turn's tokens) starts ``full``; the first False
        disables ``model`` for good (and is the only one reported)."""
        trust = self._trust.get(model, 0)
        if trust < 0:
            return True  # already known not to extend: nothing new to report
        ok = len(full) >= len(prefix) and full[: len(prefix)] == prefix
        if ok:
            self._trust[model] = trust + 1
        else:
            self._trust[model] = -1
            log.warning(
                "engine tokens: %s's chat template does not extend the previous turn's tokens; "
                "every turn waits for /tokenize",
                model,
            )
        return ok
