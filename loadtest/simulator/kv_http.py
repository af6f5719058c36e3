"""The simulator's KV-event and tokenizer routes, as vLLM 0.32 serves them.

- ``GET /kv_event_sources``: the KV-event publisher's config keyed by its DP rank, as vLLM
  0.32 answers (``{"0": {...}}``; ``enable_kv_cache_events`` false when the simulator runs
  without ``--kv-events``);
- ``POST /tokenize``: ``{"model", "messages", "add_generation_prompt"?}`` or ``{"model",
  "prompt"}`` → ``{"count", "max_model_len", "tokens", "token_strs"}``, with the simulator's
  own tokenizer and chat template, so the tokens are exactly the ones its KV cache holds;
- ``POST /reset_prefix_cache`` (vLLM's dev-mode route): drops every cached block, which
  publishes ``AllBlocksCleared``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from aiohttp import web

from .tokenizer import encode, encode_chat, real, real_chat_tokens, render_chat
from .wire import error_response

if TYPE_CHECKING:
    from .kv_events import KVEventPublisher
    from .server import SimState

__all__ = ["KVHandlers"]


class KVHandlers:
    s: SimState
    kv_publisher: KVEventPublisher | None = None

    async def kv_event_sources(self, request: web.Request) -> web.Response:
        publisher = self.kv_publisher
        if publisher is None:
            return web.json_response({"enable_kv_cache_events": False})
        if self.s.dp is not None:
            return web.json_response(self.s.dp.sources())  # one config per rank, as vLLM 0.32
        return web.json_response({str(publisher.data_parallel_rank): publisher.sources()})

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())
            if not isinstance(body, dict):
                raise ValueError("body must be an object")
            tokens = _tokens(body)
        except (ValueError, TypeError) as exc:
            return error_response(400, str(exc), "BadRequestError")
        return web.json_response(
            {
                "count": len(tokens),
                "max_model_len": self.s.config.max_model_len,
                "tokens": tokens,
                "token_strs": None,
            }
        )

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        if not self.s.engine.kv.reset_prefix_cache():
            return error_response(400, "blocks are in use", "BadRequestError")
        if self.kv_publisher is not None:
            self.kv_publisher.flush()
        return web.Response(status=200)


def _tokens(body: dict[str, Any]) -> list[int]:
    messages = body.get("messages")
    if messages is not None:
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        if real() is not None:
            return real_chat_tokens(body)
        if body.get("add_generation_prompt", True):
            return encode_chat(messages)
        return encode(render_chat(messages).removesuffix("<|start|>assistant\n"))
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return encode(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    raise ValueError("either 'messages' or a 'prompt' string is required")
