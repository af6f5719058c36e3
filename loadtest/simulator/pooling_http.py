"""The simulator's pooling and tokenizer endpoints beyond ``/tokenize`` (:mod:`.kv_http`):
``/score`` and ``/v1/score``, ``/rerank`` (also ``/v1`` and ``/v2``), ``/classify``,
``/pooling``, ``/detokenize``, with vLLM's answer shapes. Scores are word overlap (Jaccard):
deterministic, and a related document ranks above an unrelated one. Mixed into the
replica's handlers.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from aiohttp import web

from .tokenizer import content_text, encode, tokenize
from .validation import Rejected, parse_body
from .wire import error_response, json_response

__all__ = ["PoolingHandlers"]


class PoolingHandlers:
    """Mixed into the replica's handlers; ``self.s`` is its ``SimState``."""

    s: Any

    def _model_error(self, body: dict[str, Any]) -> str | None:
        model = body.get("model")
        if model is not None and model != self.s.config.model:
            return f"The model `{model}` does not exist."
        return None

    async def _pooling_body(self, request: web.Request) -> dict[str, Any] | web.Response:
        try:
            body = parse_body(await request.read())
        except Rejected as e:
            return e.response
        if (message := self._model_error(body)) is not None:
            return error_response(404, message, "NotFoundError", "model")
        return body

    def _envelope(self, kind: str, data: Any, tokens: int) -> dict[str, Any]:
        return {
            "id": f"{kind}-{secrets.token_hex(8)}",
            "object": "list",
            "created": int(time.time()),
            "model": self.s.config.model,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        }

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self._pooling_body(request)
        if isinstance(body, web.Response):
            return body
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            return error_response(400, "tokens must be a list of integers", "BadRequestError", "tokens")
        return json_response({"prompt": " ".join(f"<{t}>" for t in tokens)})

    @staticmethod
    def _similarity(a: str, b: str) -> float:
        wa, wb = set(tokenize(a.lower())), set(tokenize(b.lower()))
        return round(len(wa & wb) / max(1, len(wa | wb)), 6)

    async def score(self, request: web.Request) -> web.Response:
        body = await self._pooling_body(request)
        if isinstance(body, web.Response):
            return body
        first, second = body.get("text_1", body.get("queries")), body.get("text_2", body.get("documents"))
        if first is None or second is None:
            return error_response(400, "text_1 and text_2 are required", "BadRequestError", "text_1")
        firsts = first if isinstance(first, list) else [first]
        seconds = second if isinstance(second, list) else [second]
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        pairs = list(zip(firsts, seconds, strict=False))
        data = [
            {"index": i, "object": "score", "score": self._similarity(str(a), str(b))}
            for i, (a, b) in enumerate(pairs)
        ]
        return json_response(self._envelope("score", data, sum(len(encode(f"{a} {b}")) for a, b in pairs)))

    async def rerank(self, request: web.Request) -> web.Response:
        body = await self._pooling_body(request)
        if isinstance(body, web.Response):
            return body
        query, documents = body.get("query"), body.get("documents")
        if not isinstance(query, str) or not isinstance(documents, list):
            return error_response(400, "query and documents are required", "BadRequestError", "query")
        texts = [d if isinstance(d, str) else str(d.get("text", "")) for d in documents]
        results = [
            {"index": i, "document": {"text": t}, "relevance_score": self._similarity(query, t)}
            for i, t in enumerate(texts)
        ]
        results.sort(key=lambda r: -r["relevance_score"])
        top_n = body.get("top_n")
        if isinstance(top_n, int) and top_n > 0:
            results = results[:top_n]
        tokens = sum(len(encode(f"{query} {t}")) for t in texts)
        return json_response(
            {
                "id": f"rerank-{secrets.token_hex(8)}",
                "model": self.s.config.model,
                "usage": {"total_tokens": tokens},
                "results": results,
            }
        )

    async def _inputs(self, request: web.Request) -> tuple[dict[str, Any], list[str]] | web.Response:
        body = await self._pooling_body(request)
        if isinstance(body, web.Response):
            return body
        value = body.get("input")
        if "messages" in body:
            value = "\n".join(content_text(m.get("content")) for m in body["messages"] if isinstance(m, dict))
        if isinstance(value, str):
            return body, [value]
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            return body, value
        return error_response(400, "input must be a string or a list of strings", "BadRequestError", "input")

    async def classify(self, request: web.Request) -> web.Response:
        parsed = await self._inputs(request)
        if isinstance(parsed, web.Response):
            return parsed
        _, texts = parsed
        data = []
        for i, text in enumerate(texts):
            p = (len(encode(text)) % 10) / 10
            data.append(
                {
                    "index": i,
                    "label": "positive" if p >= 0.5 else "negative",
                    "probs": [1 - p, p],
                    "num_classes": 2,
                }
            )
        return json_response(self._envelope("classify", data, sum(len(encode(t)) for t in texts)))

    async def pooling(self, request: web.Request) -> web.Response:
        parsed = await self._inputs(request)
        if isinstance(parsed, web.Response):
            return parsed
        _, texts = parsed
        data = [
            {"index": i, "object": "pooling", "data": [((t % 97) / 97.0) for t in encode(text)[:8]]}
            for i, text in enumerate(texts)
        ]
        return json_response(self._envelope("pool", data, sum(len(encode(t)) for t in texts)))

    def add_pooling_routes(self, app: web.Application) -> None:
        router = app.router
        router.add_post("/detokenize", self.detokenize)
        for path in ("/score", "/v1/score"):
            router.add_post(path, self.score)
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            router.add_post(path, self.rerank)
        router.add_post("/classify", self.classify)
        router.add_post("/pooling", self.pooling)
