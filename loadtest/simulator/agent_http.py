"""The simulator's agent-facing APIs, as vLLM serves them: the OpenAI Responses API (with
its in-process store, as ``VLLM_ENABLE_RESPONSES_API_STORE=1``), Anthropic Messages (+
``count_tokens``), the pooling endpoints live in :mod:`.pooling_http`.

Generation runs on the same engine as chat (prefix cache, batching, aborts on disconnect);
the answers have the wire shapes the official SDKs parse. Mixed into the replica's handlers.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from .engine import FINISHED, EngineStopped, RequestTooLong, SimRequest
from .pooling_http import PoolingHandlers
from .tokenizer import encode_chat
from .validation import Rejected, parse_body
from .wire import SSE_CONTENT_TYPE, dumps, error_response, json_response

__all__ = ["AgentHandlers"]

Emit = Callable[[str, dict[str, Any]], Awaitable[None]]


def _hex_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _anthropic_error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return json_response({"type": "error", "error": {"type": kind, "message": message}}, status)


def _block_text(content: Any) -> str:
    """Responses input parts or Anthropic content blocks → plain text."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ValueError("content must be a string or a list of parts")
    out = []
    for part in content:
        if not isinstance(part, dict):
            raise ValueError("content parts must be objects")
        kind = part.get("type")
        if kind in ("text", "input_text", "output_text"):
            out.append(str(part.get("text", "")))
        elif kind == "tool_result":
            out.append(_block_text(part.get("content")))
        elif kind == "tool_use":
            out.append(f"{part.get('name')}({dumps(part.get('input'))})")
        else:
            out.append(f"<{kind}>")
    return "\n".join(out)


def _responses_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    value = body.get("input")
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise ValueError("input must be a string or a list of items")
    messages = []
    for item in value:
        if not isinstance(item, dict):
            raise ValueError("input items must be objects")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(
                {"role": str(item.get("role", "user")), "content": _block_text(item.get("content"))}
            )
        elif kind == "function_call_output":
            messages.append({"role": "tool", "content": str(item.get("output", ""))})
        else:
            messages.append({"role": "assistant", "content": dumps(item)})
    return messages


def _usage(req: SimRequest) -> dict[str, Any]:
    cached = max(0, req.num_cached_tokens)
    return {
        "input_tokens": req.num_prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": req.num_output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": req.num_prompt_tokens + req.num_output_tokens,
    }


class AgentHandlers(PoolingHandlers):
    """Mixed into the replica's handlers; ``self.s`` is its ``SimState``."""

    s: Any
    _stored: dict[str, dict[str, Any]]  # response id → {"response", "messages", "input", "req"}

    def _store(self) -> dict[str, dict[str, Any]]:
        if not hasattr(self, "_stored"):
            self._stored = {}
        return self._stored

    # ---- the engine -------------------------------------------------------------------

    def _submit(self, tokens: list[int], max_tokens: int | None) -> SimRequest:
        cfg = self.s.config
        limit = cfg.max_model_len
        if len(tokens) >= limit:
            raise RequestTooLong(f"prompt of {len(tokens)} tokens exceeds max_model_len={limit}")
        wanted = max_tokens if max_tokens is not None else cfg.default_max_tokens
        req = SimRequest(tokens, max(1, min(wanted, limit - len(tokens))), seed=len(tokens) ^ cfg.seed)
        self.s.engine.add_request(req)
        return req

    async def _tokens(
        self, request: web.Request, req: SimRequest, on_token: Callable[[str], Awaitable[None]]
    ):
        """Feed each generated word to ``on_token``; aborts the request if the client leaves."""
        try:
            while True:
                transport = request.transport
                if transport is None or transport.is_closing():
                    raise asyncio.CancelledError
                try:
                    word = await asyncio.wait_for(req.out.get(), 0.25)
                except TimeoutError:
                    continue
                if word is None:
                    break
                await on_token(word)
        except (ConnectionError, asyncio.CancelledError):
            raise asyncio.CancelledError from None
        finally:
            if req.status != FINISHED:
                self.s.engine.abort(req)

    async def _sse(self, request: web.Request) -> tuple[web.StreamResponse, Emit]:
        resp = web.StreamResponse(headers={"Content-Type": SSE_CONTENT_TYPE})
        await resp.prepare(request)

        async def emit(event: str, data: dict[str, Any]) -> None:
            await resp.write(f"event: {event}\ndata: {dumps(data)}\n\n".encode())

        return resp, emit

    # ---- Responses API ----------------------------------------------------------------

    async def responses_create(self, request: web.Request) -> web.StreamResponse:
        try:
            body = parse_body(await request.read())
        except Rejected as e:
            return e.response
        if (message := self._model_error(body)) is not None:
            return error_response(404, message, "NotFoundError", "model")
        store = self._store()
        history: list[dict[str, str]] = []
        previous = body.get("previous_response_id")
        if previous is not None:
            if previous not in store:
                return error_response(
                    404, f"Response with id '{previous}' not found.", "invalid_request_error"
                )
            history = list(store[previous]["messages"])
        instructions = body.get("instructions")
        try:
            new = _responses_messages(body)
        except ValueError as e:
            return error_response(400, str(e), "BadRequestError", "input")
        system = [{"role": "system", "content": instructions}] if isinstance(instructions, str) else []
        messages = system + [m for m in history if m["role"] != "system"] + new
        max_tokens = body.get("max_output_tokens")
        try:
            req = self._submit(encode_chat(messages), max_tokens if isinstance(max_tokens, int) else None)
        except (RequestTooLong, EngineStopped, ValueError) as e:
            return error_response(400, str(e), "BadRequestError", "input")
        response_id, item_id = _hex_id("resp"), _hex_id("msg")
        response: dict[str, Any] = {
            "id": response_id,
            "object": "response",
            "created_at": int(time.time()),
            "model": self.s.config.model,
            "status": "in_progress",
            "output": [],
            "previous_response_id": previous,
            "instructions": instructions,
            "parallel_tool_calls": True,
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [],
            "temperature": body.get("temperature", 1.0),
            "top_p": body.get("top_p", 1.0),
            "max_output_tokens": max_tokens,
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "metadata": body.get("metadata") or {},
            "incomplete_details": None,
            "error": None,
            "usage": None,
        }
        entry = {"response": response, "messages": messages, "input": body.get("input"), "req": req}
        if body.get("store", True) is not False:
            store[response_id] = entry
        words: list[str] = []
        seq = 0

        def finish() -> None:
            text = " ".join(words)
            content = {"type": "output_text", "text": text, "annotations": []}
            item = {"id": item_id, "type": "message", "role": "assistant", "status": "completed"}
            response["output"] = [{**item, "content": [content]}]
            cancelled = response["status"] == "cancelled"
            response["status"] = "cancelled" if cancelled else "completed"
            if req.finish_reason == "length":
                response["status"] = "incomplete"
                response["incomplete_details"] = {"reason": "max_output_tokens"}
            response["usage"] = _usage(req)
            entry["messages"] = [*messages, {"role": "assistant", "content": text}]

        if not body.get("stream"):

            async def collect(word: str) -> None:
                words.append(word)

            await self._tokens(request, req, collect)
            finish()
            return json_response(response)

        resp, emit = await self._sse(request)

        async def event(kind: str, **data: Any) -> None:
            nonlocal seq
            await emit(kind, {"type": kind, "sequence_number": seq, **data})
            seq += 1

        await event("response.created", response=response)
        await event("response.in_progress", response=response)
        item = {"id": item_id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
        await event("response.output_item.added", output_index=0, item=item)
        part = {"type": "output_text", "text": "", "annotations": []}
        await event(
            "response.content_part.added", item_id=item_id, output_index=0, content_index=0, part=part
        )

        async def delta(word: str) -> None:
            piece = word if not words else " " + word
            words.append(word)
            await event(
                "response.output_text.delta",
                item_id=item_id,
                output_index=0,
                content_index=0,
                delta=piece,
                logprobs=[],
            )

        await self._tokens(request, req, delta)
        finish()
        text = response["output"][0]["content"][0]["text"]
        where = {"item_id": item_id, "output_index": 0, "content_index": 0}
        await event("response.output_text.done", **where, text=text, logprobs=[])
        await event("response.content_part.done", **where, part={**part, "text": text})
        await event("response.output_item.done", output_index=0, item=response["output"][0])
        await event("response.completed", response=response)
        await resp.write_eof()
        return resp

    def _stored_or_404(self, request: web.Request) -> dict[str, Any] | web.Response:
        response_id = request.match_info["response_id"]
        entry = self._store().get(response_id)
        if entry is None:
            return error_response(
                404, f"Response with id '{response_id}' not found.", "invalid_request_error"
            )
        return entry

    async def responses_get(self, request: web.Request) -> web.Response:
        entry = self._stored_or_404(request)
        return entry if isinstance(entry, web.Response) else json_response(entry["response"])

    async def responses_delete(self, request: web.Request) -> web.Response:
        entry = self._stored_or_404(request)
        if isinstance(entry, web.Response):
            return entry
        response_id = request.match_info["response_id"]
        del self._store()[response_id]
        return json_response({"id": response_id, "object": "response", "deleted": True})

    async def responses_cancel(self, request: web.Request) -> web.Response:
        entry = self._stored_or_404(request)
        if isinstance(entry, web.Response):
            return entry
        if entry["response"]["status"] != "in_progress":
            return error_response(400, "Cannot cancel a response that is not in progress.", "BadRequestError")
        entry["response"]["status"] = "cancelled"
        self.s.engine.abort(entry["req"])
        return json_response(entry["response"])

    async def responses_input_items(self, request: web.Request) -> web.Response:
        entry = self._stored_or_404(request)
        if isinstance(entry, web.Response):
            return entry
        value = entry["input"]
        items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}]
        if isinstance(value, list):
            items = value
        data = [{"id": f"item_{i}", **item} for i, item in enumerate(items)]
        first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
        return json_response(
            {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": False}
        )

    # ---- Anthropic Messages -----------------------------------------------------------

    def _anthropic_tokens(self, body: dict[str, Any]) -> list[int] | web.Response:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return _anthropic_error(400, "messages: Field required")
        try:
            rendered = [{"role": m["role"], "content": _block_text(m.get("content"))} for m in messages]
            system = body.get("system")
            if system is not None:
                rendered.insert(0, {"role": "system", "content": _block_text(system)})
        except (ValueError, KeyError, TypeError) as e:
            return _anthropic_error(400, f"messages: {e}")
        return encode_chat(rendered)

    async def messages_count_tokens(self, request: web.Request) -> web.Response:
        try:
            body = parse_body(await request.read())
        except Rejected:
            return _anthropic_error(400, "invalid JSON body")
        tokens = self._anthropic_tokens(body)
        return tokens if isinstance(tokens, web.Response) else json_response({"input_tokens": len(tokens)})

    async def messages(self, request: web.Request) -> web.StreamResponse:
        try:
            body = parse_body(await request.read())
        except Rejected:
            return _anthropic_error(400, "invalid JSON body")
        if (message := self._model_error(body)) is not None:
            return _anthropic_error(404, message, "not_found_error")
        max_tokens = body.get("max_tokens")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            return _anthropic_error(400, "max_tokens: Field required")
        tokens = self._anthropic_tokens(body)
        if isinstance(tokens, web.Response):
            return tokens
        try:
            req = self._submit(tokens, max_tokens)
        except (RequestTooLong, EngineStopped, ValueError) as e:
            return _anthropic_error(400, str(e))
        message_id = _hex_id("msg")
        words: list[str] = []

        def usage() -> dict[str, int]:
            return {
                "input_tokens": req.num_prompt_tokens,
                "cache_read_input_tokens": max(0, req.num_cached_tokens),
                "output_tokens": req.num_output_tokens,
            }

        def stop_reason() -> str:
            return "max_tokens" if req.finish_reason == "length" else "end_turn"

        shell = {"id": message_id, "type": "message", "role": "assistant", "model": self.s.config.model}
        if not body.get("stream"):

            async def collect(word: str) -> None:
                words.append(word)

            await self._tokens(request, req, collect)
            content = [{"type": "text", "text": " ".join(words)}]
            return json_response(
                {
                    **shell,
                    "content": content,
                    "stop_reason": stop_reason(),
                    "stop_sequence": None,
                    "usage": usage(),
                }
            )
        resp, emit = await self._sse(request)
        start = {**shell, "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage()}
        await emit("message_start", {"type": "message_start", "message": start})
        block = {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
        await emit("content_block_start", block)
        await emit("ping", {"type": "ping"})

        async def delta(word: str) -> None:
            piece = word if not words else " " + word
            words.append(word)
            data = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}}
            await emit("content_block_delta", data)

        await self._tokens(request, req, delta)
        await emit("content_block_stop", {"type": "content_block_stop", "index": 0})
        end = {"stop_reason": stop_reason(), "stop_sequence": None}
        await emit("message_delta", {"type": "message_delta", "delta": end, "usage": usage()})
        await emit("message_stop", {"type": "message_stop"})
        await resp.write_eof()
        return resp

    def add_agent_routes(self, app: web.Application) -> None:
        router = app.router
        router.add_post("/v1/responses", self.responses_create)
        router.add_get("/v1/responses/{response_id}", self.responses_get)
        router.add_delete("/v1/responses/{response_id}", self.responses_delete)
        router.add_post("/v1/responses/{response_id}/cancel", self.responses_cancel)
        router.add_get("/v1/responses/{response_id}/input_items", self.responses_input_items)
        router.add_post("/v1/messages", self.messages)
        router.add_post("/v1/messages/count_tokens", self.messages_count_tokens)
        self.add_pooling_routes(app)
