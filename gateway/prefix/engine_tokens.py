"""The engine's own tokens for a request's prompt, after its chat template: ``POST /tokenize``.

Exact prefix matching compares token blocks, so the gateway asks the engine (vLLM's
``/tokenize`` takes the chat request's ``messages`` and the template options, or a
completion's ``prompt``) once per request, with a short timeout, and only when a policy
asks for an exact match. Answers are kept in a bounded LRU keyed by the canonical prompt
(and the template options), so a conversation's retries, P/D legs, regenerations and
repeated prompts pay once; with ``reuse_turn_tokens`` a conversation's next turn is matched
on the previous turn's tokens while its own are fetched off the critical path
(``turn_tokens``). Requests
the exact index cannot describe — multimodal parts
(their blocks carry media hashes), a ``cache_salt``, batched prompts, other APIs — get
``None``: the approximate index answers for them.

With a :class:`LocalTokens` (``prefix.kv_events.tokenizer``) the tokens are computed in the
gateway instead — no round trip — and ``/tokenize`` is asked only to verify a model's
first answers, or where the local path cannot reproduce the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Coroutine
from typing import Any

import aiohttp
import xxhash

from gateway.fleet.endpoint import Endpoint
from gateway.ops.kv_metrics import KVEventMetrics
from gateway.prefix.local_tokens import LocalTokens
from gateway.prefix.token_cache import TokenCache
from gateway.prefix.turn_tokens import TurnTokens
from gateway.request.types import InferenceRequest

__all__ = ["EngineTokens", "tokenize_body"]

log = logging.getLogger(__name__)

_MAX_BACKGROUND = 64  # background tokenizations in flight; more: the next turn waits instead

# Chat fields that change what the template renders, passed to /tokenize as given.
_TEMPLATE_FIELDS = (
    "tools", "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
    "add_special_tokens", "documents",
)  # fmt: skip


def _text_only(messages: list[Any]) -> bool:
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
            not isinstance(part, dict) or part.get("type") != "text" for part in content
        ):
            return False
    return True


def tokenize_body(request: InferenceRequest) -> dict[str, Any] | list[int] | None:
    """What to send to ``/tokenize`` for ``request``; the tokens themselves for a token prompt."""
    body = request.body
    if "cache_salt" in body:
        return None
    if request.api == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not _text_only(messages):
            return None
        out: dict[str, Any] = {"model": request.model, "messages": messages}
        out.update((k, body[k]) for k in _TEMPLATE_FIELDS if k in body)
        return out
    if request.api == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            out = {"model": request.model, "prompt": prompt}
            if "add_special_tokens" in body:
                out["add_special_tokens"] = body["add_special_tokens"]
            return out
        # token ids as the engines hash them (uint32): any other is no token, and the engine says so
        if isinstance(prompt, list) and prompt and all(type(t) is int and 0 <= t < 2**32 for t in prompt):
            return prompt
    return None


class EngineTokens:
    def __init__(
        self,
        metrics: KVEventMetrics,
        *,
        timeout_s: float,
        cache_entries: int,
        reuse_turns: bool = False,
        local: LocalTokens | None = None,
    ) -> None:
        self.session: aiohttp.ClientSession | None = None  # the app's, set when it starts
        self.local = local
        self._metrics = metrics
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._cache = TokenCache(cache_entries)
        self._turns = TurnTokens(cache_entries) if reuse_turns and cache_entries else None
        self._background: set[asyncio.Task[None]] = set()

    def _key(self, request: InferenceRequest, body: dict[str, Any]) -> bytes:
        extras = {k: v for k, v in body.items() if k not in ("model", "messages", "prompt")}
        hasher = xxhash.xxh3_128(f"{request.api}\x00{request.model}\x00".encode())
        hasher.update(request.prompt_text.encode("utf-8", "surrogatepass"))
        if extras:
            hasher.update(json.dumps(extras, sort_keys=True, default=str).encode())
        return hasher.digest()

    async def tokens(self, request: InferenceRequest, endpoint: Endpoint) -> list[int] | None:
        """The engine's prompt tokens for ``request`` (asking ``endpoint``), or None."""
        body = tokenize_body(request)
        if body is None:
            self._metrics.tokenize.labels("skipped").inc()
            return None
        if isinstance(body, list):
            return body
        key = self._key(request, body)
        cached = self._cache.get(key)
        if cached is not None:
            self._metrics.tokenize.labels("cached").inc()
            return cached[0].tolist()
        return await self._fetch(request, body, key, endpoint, None)

    async def routing_tokens(self, request: InferenceRequest, endpoint: Endpoint) -> tuple[list[int], int]:
        """``(tokens, prompt tokens)`` to match on: all of the prompt's engine tokens, or — for a
        conversation's next turn, once the model's template is known to extend turns — the
        previous turn's (a prefix of them) with an estimate of the whole, the full tokens being
        fetched in the background. ``([], 0)``: no engine tokens for this request."""
        body = tokenize_body(request)
        turns = self._turns
        if turns is not None and isinstance(body, dict) and "messages" in body:
            key = self._key(request, body)
            if key not in self._cache and turns.trusted(request.model):
                previous = turns.previous(request, body)
                if previous is not None:
                    prefix, chars = previous
                    self._metrics.tokenize.labels("previous_turn").inc()
                    self._spawn(self._fetch(request, body, key, endpoint, prefix))
                    total = round(len(request.prompt_text) * len(prefix) / max(1, chars))
                    return prefix, max(total, len(prefix) + 1)
        tokens = await self.tokens(request, endpoint)
        return (tokens, len(tokens)) if tokens else ([], 0)

    async def _fetch(
        self,
        request: InferenceRequest,
        body: dict[str, Any],
        key: bytes,
        endpoint: Endpoint,
        prefix: list[int] | None,
    ) -> list[int] | None:
        turns = self._turns
        previous = prefix
        if previous is None and turns is not None and "messages" in body:
            found = turns.previous(request, body)
            previous = found[0] if found is not None else None
        tokens = await self._resolve(request, body, endpoint)
        if tokens is None:
            return None
        self._cache.put(key, tokens)
        if turns is not None and "messages" in body:
            turns.store(request, body, tokens)
            if previous is not None and not turns.verify(request.model, previous, tokens):
                self._metrics.tokenize.labels("previous_turn_mismatch").inc()
        return tokens

    async def _resolve(
        self, request: InferenceRequest, body: dict[str, Any], endpoint: Endpoint
    ) -> list[int] | None:
        """Local tokens where trusted; the engine's while a model is being verified or the local
        path cannot answer (``auto``), or nothing (``local``: the approximate index answers)."""
        local = self.local
        if local is None or local.distrusted(request.model):
            return await self._ask(endpoint, body)
        mine = await local.tokens(request)
        if mine is None:
            return await self._ask(endpoint, body) if local.engine_fallback else None
        if local.trusted(request):
            if local.recheck_due(request):
                self._spawn(self._recheck(request.model, mine, endpoint, body))
            return mine
        engine = await self._ask(endpoint, body)  # not yet verified: the engine's answer is used
        if engine is not None and local.comparable(request):
            local.check(request.model, mine, engine)
        return engine

    async def _recheck(self, model: str, mine: list[int], endpoint: Endpoint, body: dict[str, Any]) -> None:
        engine = await self._ask(endpoint, body)
        if engine is not None and self.local is not None:
            self.local.check(model, mine, engine)

    def _spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        if len(self._background) >= _MAX_BACKGROUND:
            work.close()
            return
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _ask(self, endpoint: Endpoint, body: dict[str, Any]) -> list[int] | None:
        if self.session is None:
            return None
        started = time.perf_counter()
        try:
            async with self.session.post(
                endpoint.base_url + "/tokenize",
                json=body,
                timeout=self._timeout,
                headers={"authorization": endpoint.auth_header} if endpoint.auth_header else None,
                ssl=endpoint.ssl_context or True,
            ) as resp:
                if resp.status != 200:
                    raise ValueError(f"status {resp.status}")
                answer = await resp.json(content_type=None)
            tokens = answer.get("tokens") if isinstance(answer, dict) else None
            if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < 2**32 for t in tokens):
                raise ValueError("no token list in the answer")
        except TimeoutError:
            self._metrics.tokenize.labels("timeout").inc()
            log.debug("tokenize on %s timed out", endpoint.name)
            return None
        except (aiohttp.ClientError, ValueError, UnicodeDecodeError) as exc:
            self._metrics.tokenize.labels("error").inc()
            log.debug("tokenize on %s failed: %s", endpoint.name, exc)
            return None
        finally:
            self._metrics.tokenize_seconds.observe(time.perf_counter() - started)
        self._metrics.tokenize.labels("ok").inc()
        return tokens
