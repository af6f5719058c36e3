"""Tiny controllable OpenAI-compatible upstreams for what the simulator cannot express.

One aiohttp app, real sockets, behaviour switched by attributes the test sets:

- ``mode = "ok"``: answers chat / completions / embeddings (SSE when ``stream``);
- ``mode = "gated"``: streams the first SSE chunk, then waits on ``gate`` before the rest;
- ``mode = "hold"``: streams the first chunk (or, non-streaming, nothing at all) and then
  waits forever; ``cancelled`` is set when the handler is cancelled (connection closed);
- ``mode = "die"``: sends the headers and the first bytes, then aborts the TCP connection;
- ``mode = "cut-mid-event"``: streams the first chunk, then half of an event, then aborts;
- ``mode = "status"``: answers ``status`` with ``body`` byte for byte (4xx / 5xx cases);
- ``mode = "status-stall"``: sends ``status`` and the headers, then stalls inside the body;
- ``/v1/responses`` and ``/v1/messages`` streams are typed events (:func:`typed_events`), with
  the ``open-then-die`` / ``open-then-end`` / ``open-then-gated`` modes besides.

``metrics_text`` is served on ``/metrics`` (``metrics_mode`` "ok" | "error" | "hang"; counted in
``metrics_asked``),
``healthy`` drives ``/health``, and every inference request is recorded in ``requests``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web

__all__ = ["Received", "Upstream", "running_upstream", "vllm_metrics"]

CHUNKS = ("Hello", " from", " the", " upstream")


def vllm_metrics(waiting: float = 0.0, running: float = 0.0, kv: float = 0.0, model: str = "tiny") -> str:
    """A minimal vLLM-style /metrics page with the families the gateway reads."""
    labels = f'engine="0",model_name="{model}"'
    return (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        f"vllm:num_requests_running{{{labels}}} {running}\n"
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        f"vllm:num_requests_waiting{{{labels}}} {waiting}\n"
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f"vllm:kv_cache_usage_perc{{{labels}}} {kv}\n"
    )


# The engines' wider surface (Responses, Messages, pooling, tokenizer): answered with a generic JSON.
ENGINE_PATHS = (
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/rerank",
    "/rerank",
    "/v2/rerank",
    "/v1/score",
    "/score",
    "/classify",
    "/pooling",
    "/tokenize",
    "/detokenize",
)

AUDIO_PATHS = ("/v1/audio/transcriptions", "/v1/audio/translations")  # multipart/form-data


@dataclass
class Received:
    path: str
    headers: dict[str, str]  # lower-cased names
    raw: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.raw)


class Upstream:
    def __init__(self, models: tuple[str, ...] = ("tiny",), metrics_text: str | None = None) -> None:
        self.models = list(models)
        self.metrics_text = vllm_metrics(model=models[0]) if metrics_text is None else metrics_text
        self.metrics_mode = "ok"
        self.metrics_asked = 0  # /metrics requests received
        self.health_asked = 0  # /health requests received
        self.healthy = True
        self.mode = "ok"
        self.status = 400
        self.body = b'{"error": {"message": "upstream says no", "type": "BadRequestError"}}'
        self.content_type = "application/json"
        self.gate = asyncio.Event()
        self.paced_s = 1.0  # "paced-then-gated": events every pace_s for paced_s, then the gate
        self.pace_s = 0.05
        self.first_chunk_sent = asyncio.Event()
        self.rest_sent = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.requests: list[Received] = []
        self.url = ""
        self.port = 0
        self._runner: web.AppRunner | None = None

    # ---- lifecycle -------------------------------------------------------------
    own_paths: tuple[str, ...] = ()  # POST paths a subclass answers itself (_add_routes)

    def _add_routes(self, app: web.Application) -> None:
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        openai_paths = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
        for path in (*openai_paths, *ENGINE_PATHS, *AUDIO_PATHS):
            if path not in self.own_paths:
                app.router.add_post(path, self._inference)

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)  # audio files up to 25 MB
        self._add_routes(app)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        """Close the listening socket and every connection: the port then refuses."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    @property
    def name(self) -> str:
        return self.url.split("://", 1)[1]

    # ---- handlers ----------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        self.health_asked += 1
        return web.Response(status=200 if self.healthy else 503)

    async def _models(self, request: web.Request) -> web.Response:
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "tiny"} for m in self.models]
        return web.json_response({"object": "list", "data": data})

    async def _metrics(self, request: web.Request) -> web.Response:
        self.metrics_asked += 1
        if self.metrics_mode == "error":
            return web.Response(status=500, text="broken")
        if self.metrics_mode == "hang":
            await asyncio.Event().wait()
        return web.Response(text=self.metrics_text, content_type="text/plain")

    async def _inference(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.requests.append(Received(request.path, {k.lower(): v for k, v in request.headers.items()}, raw))
        if self.mode == "status":
            return web.Response(status=self.status, body=self.body, content_type=self.content_type)
        if self.mode == "status-stall":  # status line and headers, then the body never comes
            resp = web.StreamResponse(status=self.status, headers={"Content-Type": self.content_type})
            resp.content_length = len(self.body) + 1
            await resp.prepare(request)
            await resp.write(self.body[:1])
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        if request.path in AUDIO_PATHS:  # multipart: the test reads the form from ``requests``
            usage = {"type": "duration", "seconds": 1}
            return web.json_response({"text": "hello from the upstream", "usage": usage})
        body = json.loads(raw)
        model = body.get("model", "")
        if request.path == "/v1/embeddings":
            data = [{"object": "embedding", "index": 0, "embedding": [0.25, -0.5, 1.0]}]
            usage = {"prompt_tokens": 2, "total_tokens": 2}
            return web.json_response({"object": "list", "data": data, "model": model, "usage": usage})
        streams = body.get("stream") and request.path in ("/v1/responses", "/v1/messages")
        if request.path in ENGINE_PATHS and not streams:  # the engines' other APIs: any JSON
            return web.json_response({"id": "resp_fake", "object": "fake", "model": model, "usage": {}})
        chat = request.path == "/v1/chat/completions"
        try:
            if streams:
                return await self._typed_stream(request, model)
            if body.get("stream"):
                return await self._stream(request, chat, model)
            return await self._complete(request, chat, model)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def _complete(self, request: web.Request, chat: bool, model: str) -> web.StreamResponse:
        if self.mode == "hold":
            await asyncio.Event().wait()
        if self.mode == "die":
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            resp.content_length = 4096
            await resp.prepare(request)
            await resp.write(b'{"id": "cmpl-partial", ')
            self._abort(request)
            return resp
        text = "".join(CHUNKS)
        if chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text}
            obj = "text_completion"
        # "abort": what vLLM answers in-flight requests when it is shutting down.
        choice.update(finish_reason="abort" if self.mode == "abort" else "stop", logprobs=None)
        usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
        out = {"id": "cmpl-1", "object": obj, "created": 0, "model": model, "choices": [choice]}
        return web.json_response({**out, "usage": usage})

    async def _stream(self, request: web.Request, chat: bool, model: str) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def send(index: int) -> None:
            text = CHUNKS[index]
            finish = "stop" if index == len(CHUNKS) - 1 else None
            if chat:
                choice: dict[str, Any] = {"index": 0, "delta": {"content": text}}
                obj = "chat.completion.chunk"
            else:
                choice = {"index": 0, "text": text}
                obj = "text_completion"
            choice.update(finish_reason=finish, logprobs=None)
            payload = {"id": "cmpl-1", "object": obj, "created": 0, "model": model, "choices": [choice]}
            await resp.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

        if chat and self.mode in ("role-then-die", "role-then-gated"):  # vLLM's opening chunk
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            opening = {"id": "cmpl-1", "object": "chat.completion.chunk", "created": 0, "model": model}
            await resp.write(b"data: " + json.dumps({**opening, "choices": [role]}).encode() + b"\n\n")
            self.first_chunk_sent.set()
            if self.mode == "role-then-die":
                self._abort(request)
                return resp
            await self.gate.wait()
        if self.mode == "half-event-then-hold":  # the first bytes are half an event, then nothing
            await resp.write(b'data: {"id": "cmpl-1", "object": "chat.completion.chunk", "choices": [{"del')
            self.first_chunk_sent.set()
            await asyncio.Event().wait()
        await send(0)
        self.first_chunk_sent.set()
        if self.mode == "gated":
            await self.gate.wait()
        elif self.mode == "hold":
            await asyncio.Event().wait()
        elif self.mode == "die":
            self._abort(request)
            return resp
        elif self.mode == "paced-then-gated":
            until = asyncio.get_running_loop().time() + self.paced_s
            while asyncio.get_running_loop().time() < until:
                await asyncio.sleep(self.pace_s)
                await send(1)
            await self.gate.wait()
        elif self.mode == "cut-mid-event":
            await resp.write(b'data: {"id": "cmpl-1", "object": "chat.completion.chunk", "choices": [{"par')
            await asyncio.sleep(0.05)  # let the gateway forward the half event before the cut
            self._abort(request)
            return resp
        for index in range(1, len(CHUNKS)):
            await send(index)
        await resp.write(b"data: [DONE]\n\n")
        self.rest_sent.set()
        await resp.write_eof()
        return resp

    async def _typed_stream(self, request: web.Request, model: str) -> web.StreamResponse:
        """A Responses or Messages stream as vLLM writes it: opening events, text deltas, the end.

        ``mode`` "open-then-die" / "open-then-end" / "open-then-gated": the opening events
        only, then an abort / a clean end / the gate; "die" and "cut-mid-event" as for chat,
        after the first text delta."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        opening, deltas, closing = typed_events(request.path, model)

        async def send(event: dict[str, Any]) -> None:
            await resp.write(f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode())

        for event in opening:
            await send(event)
        if self.mode.startswith("open-then-"):
            self.first_chunk_sent.set()
            if self.mode == "open-then-die":
                self._abort(request)
                return resp
            if self.mode == "open-then-end":
                await resp.write_eof()
                return resp
            await self.gate.wait()
        await send(deltas[0])
        self.first_chunk_sent.set()
        if self.mode == "die":
            self._abort(request)
            return resp
        if self.mode == "cut-mid-event":
            await resp.write(b'event: x\ndata: {"type": "x", "par')
            await asyncio.sleep(0.05)
            self._abort(request)
            return resp
        for event in (*deltas[1:], *closing):
            await send(event)
        self.rest_sent.set()
        await resp.write_eof()
        return resp

    @staticmethod
    def _abort(request: web.Request) -> None:
        transport = request.transport
        assert transport is not None
        transport.abort()


Events = list[dict[str, Any]]


def typed_events(path: str, model: str) -> tuple[Events, Events, Events]:
    """(opening, text deltas, closing) events of a Responses (``/v1/responses``) or Messages stream."""
    if path == "/v1/messages":
        message = {"id": "msg_1", "type": "message", "role": "assistant", "model": model, "content": []}
        message |= {"stop_reason": None, "stop_sequence": None}
        message["usage"] = {"input_tokens": 3, "output_tokens": 0}
        opening = [
            {"type": "message_start", "message": message},
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        ]
        deltas = [
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}
            for text in CHUNKS
        ]
        closing = [
            {"type": "content_block_stop", "index": 0},
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": len(CHUNKS)},
            },
            {"type": "message_stop"},
        ]
        return opening, deltas, closing
    response = {"id": "resp_typed", "object": "response", "created_at": 0, "model": model}
    response["status"] = "in_progress"
    response |= {"output": [], "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}
    item = {"id": "msg_1", "type": "message", "role": "assistant", "status": "in_progress", "content": []}
    part = {"type": "output_text", "text": "", "annotations": []}
    opening = [
        {"type": "response.created", "sequence_number": 0, "response": response},
        {"type": "response.in_progress", "sequence_number": 1, "response": response},
        {"type": "response.output_item.added", "sequence_number": 2, "output_index": 0, "item": item},
        {
            "type": "response.content_part.added",
            "sequence_number": 3,
            "item_id": "msg_1",
            "output_index": 0,
            "content_index": 0,
            "part": part,
        },
    ]
    where = {"item_id": "msg_1", "output_index": 0, "content_index": 0, "logprobs": []}
    deltas = [
        {"type": "response.output_text.delta", "sequence_number": 4 + i, "delta": text, **where}
        for i, text in enumerate(CHUNKS)
    ]
    text = "".join(CHUNKS)
    usage = {"input_tokens": 3, "output_tokens": len(CHUNKS), "total_tokens": 3 + len(CHUNKS)}
    usage |= {"input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}
    done_item = {**item, "status": "completed", "content": [{**part, "text": text}]}
    done = {**response, "status": "completed", "output": [done_item], "usage": usage}
    closing = [
        {"type": "response.output_text.done", "sequence_number": 8, "text": text, **where},
        {"type": "response.output_item.done", "sequence_number": 9, "output_index": 0, "item": done_item},
        {"type": "response.completed", "sequence_number": 10, "response": done},
    ]
    return opening, deltas, closing


@contextlib.asynccontextmanager
async def running_upstream(
    models: tuple[str, ...] = ("tiny",), metrics_text: str | None = None
) -> AsyncIterator[Upstream]:
    upstream = Upstream(models, metrics_text)
    await upstream.start()
    try:
        yield upstream
    finally:
        upstream.gate.set()
        await upstream.stop()
