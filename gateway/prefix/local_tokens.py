"""Per served model: its local tokenizer (loaded once, off the loop) and whether to trust it.

``auto`` trusts a model's local tokens only after its first ``verify_requests`` answers
equalled the engine's ``/tokenize`` (those requests use the engine's answer), then
compares one request in ``reverify_every`` in the background; one mismatch sends the
model back to ``/tokenize`` for good (a tokenizer class or template feature this path
does not reproduce, a server ``--chat-template``). ``local`` trusts at once and never asks
the engine. Every request the local path does not answer is counted by reason.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gateway.config.kv_events import TokenizerConfig
from gateway.ops.kv_metrics import KVEventMetrics
from gateway.prefix.chat_template import Unsupported
from gateway.prefix.local_tokenizer import LocalTokenizer, find_tokenizer_dir
from gateway.request.types import InferenceRequest

__all__ = ["LocalTokens"]

log = logging.getLogger(__name__)

# chat fields /tokenize does not take but the chat completion renders: no verification on these
_NOT_COMPARABLE = ("documents", "reasoning_effort")


class LocalTokens:
    def __init__(self, settings: TokenizerConfig, metrics: KVEventMetrics) -> None:
        self.settings = settings
        self.engine_fallback = settings.source == "auto"
        self._metrics = metrics
        self._pool = ThreadPoolExecutor(max_workers=settings.threads, thread_name_prefix="llmgw-tokenize")
        self._loaded: dict[str, LocalTokenizer | None] = {}
        self._loading: dict[str, asyncio.Future[LocalTokenizer | None]] = {}
        self._checks: dict[str, int] = {}  # model → confirmations so far; -1: never trusted again
        self._seen: dict[str, int] = {}
        self._by_dir: dict[Path, LocalTokenizer | None] = {}
        for directory in {*settings.models.values(), *([settings.path] if settings.path else [])}:
            self._by_dir[Path(directory)] = self._open(Path(directory))

    def _fallback(self, reason: str) -> None:
        self._metrics.local_tokenize.labels("fallback", reason).inc()

    def _open(self, directory: Path) -> LocalTokenizer | None:
        try:
            tokenizer = LocalTokenizer(directory)
        except Exception as exc:  # a broken tokenizer.json or config: the engine answers instead
            log.warning("local tokenizer in %s does not load: %s", directory, exc)
            return None
        log.info("local tokenizer loaded from %s", directory)
        return tokenizer

    async def tokenizer(self, model: str) -> LocalTokenizer | None:
        """The model's tokenizer. Configured directories are loaded at start; one found in the
        HF cache loads in the pool, and with an engine to fall back on no request waits for it."""
        if model in self._loaded:
            return self._loaded[model]
        s = self.settings
        directory = find_tokenizer_dir(model, models=s.models, path=s.path, hf_cache=s.hf_cache)
        if directory is None or directory in self._by_dir:
            found = self._loaded[model] = self._by_dir.get(directory) if directory else None
            return found
        pending = self._loading.get(model)
        if pending is None:
            pending = asyncio.get_running_loop().run_in_executor(self._pool, self._open, directory)
            pending.add_done_callback(lambda f: self._done(model, f))
            self._loading[model] = pending
        if self.engine_fallback and not pending.done():
            return None
        return await asyncio.shield(pending)

    def _done(self, model: str, future: asyncio.Future[LocalTokenizer | None]) -> None:
        self._loading.pop(model, None)
        self._loaded[model] = None if future.cancelled() or future.exception() else future.result()

    def distrusted(self, model: str) -> bool:
        return self._checks.get(model, 0) < 0

    def trusted(self, request: InferenceRequest) -> bool:
        return not self.engine_fallback or self._checks.get(request.model, 0) >= self.settings.verify_requests

    @staticmethod
    def comparable(request: InferenceRequest) -> bool:
        """Whether ``/tokenize`` renders this request as the chat completion does."""
        return not any(k in request.body for k in _NOT_COMPARABLE)

    def recheck_due(self, request: InferenceRequest) -> bool:
        every = self.settings.reverify_every
        if not self.engine_fallback or not every or not self.comparable(request):
            return False
        seen = self._seen[request.model] = self._seen.get(request.model, 0) + 1
        return seen % every == 0

    def check(self, model: str, local: list[int], engine: list[int]) -> bool:
        """Record whether the local tokens equal the engine's; the first mismatch distrusts ``model``."""
        if self.distrusted(model):
            return False
        if local == engine:
            self._checks[model] = self._checks.get(model, 0) + 1
            self._metrics.local_tokenize.labels("verified", "").inc()
            return True
        self._checks[model] = -1
        self._metrics.local_tokenize.labels("mismatch", "").inc()
        at = next((i for i, (a, b) in enumerate(zip(local, engine, strict=False)) if a != b), None)
        log.warning(
            "local tokens for %s differ from the engine's (%d vs %d tokens, first difference at %s): "
            "back to /tokenize for this model",
            model, len(local), len(engine), min(len(local), len(engine)) if at is None else at,
        )  # fmt: skip
        return False

    async def tokens(self, request: InferenceRequest) -> list[int] | None:
        """The prompt's engine tokens computed here, or None (counted by reason)."""
        # The prompt text leaves out tools and counts a message as a few characters: a body of
        # 13 MB of tools, or 200,000 tiny messages, passed it and rendered (on the loop) and
        # encoded for seconds. What the template renders is bounded by the body's size first.
        limit = self.settings.max_prompt_chars
        if len(request.prompt_text) > limit or len(request.raw_body) > limit:
            self._fallback("too_long")
            return None
        tokenizer = await self.tokenizer(request.model)
        if tokenizer is None:
            self._fallback("loading" if request.model in self._loading else "no_tokenizer")
            return None
        started = time.perf_counter()
        try:
            prepared = tokenizer.prepare(request.api, request.body)
            if len(prepared.text) > limit:
                raise Unsupported("too_long")
            # A worker thread waits for the GIL twice (to start, and after the encode, which
            # releases it) while the loop runs: up to the 5 ms switch interval each, more than
            # encoding ~4k tokens costs here (1.5 ms). Shorter work stays on the loop. Text that
            # is not ASCII (CJK, emoji) is up to a token a character: a quarter of the limit.
            remaining = prepared.remaining
            limit = self.settings.inline_chars
            if remaining and not prepared.text[-remaining:].isascii():
                limit //= 4
            if remaining <= limit:
                tokens = tokenizer.finish(prepared)
            else:
                tokens = await asyncio.get_running_loop().run_in_executor(
                    self._pool, tokenizer.finish, prepared
                )
        except Unsupported as exc:
            self._fallback(exc.reason)
            return None
        except Exception as exc:  # whatever a template or input does: never a failed request
            log.debug("local tokenization for %s failed: %r", request.model, exc)
            self._fallback("error")
            return None
        finally:
            self._metrics.local_tokenize_seconds.observe(time.perf_counter() - started)
        self._metrics.local_tokenize.labels("ok", "").inc()
        return tokens

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
