"""A scriptable Responses-API replica on a real socket (what the shared upstream fixture cannot say):
it stores responses, answers GET/DELETE/cancel/input_items, and can compress or stream its answers."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from tests.support.upstreams import vllm_metrics


class Replica:
    def __init__(self, model: str = "tiny") -> None:
        self.model = model
        self.stored: dict[str, dict[str, Any]] = {}
        self.seen: list[tuple[str, str, dict[str, str]]] = []  # method, raw path, headers: every request
        self.compress = False  # gzip the answers of GET /v1/responses/{id} when the client accepts it
        # "ok" | "sse-die": GET ?stream=true streams an event, then the socket dies | "sse-stall": it
        # streams an event, then nothing | "hang": GET answers nothing at all
        self.get_mode = "ok"
        self.metrics_text: str | None = None  # /metrics: an idle engine's unless set
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._counter = 0

    async def start(self) -> None:
        @web.middleware
        async def note_all(request: web.Request, handler):
            self._note(request)
            return await handler(request)

        app = web.Application(middlewares=[note_all])
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/responses", self._create)
        app.router.add_get("/v1/responses/{rid}", self._get)
        app.router.add_delete("/v1/responses/{rid}", self._delete)
        app.router.add_route("*", "/{tail:.*}", self._other)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    @property
    def name(self) -> str:
        return self.url.split("://", 1)[1]

    async def stop(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    def _note(self, request: web.Request) -> None:
        self.seen.append(
            (request.method, request.raw_path, {k.lower(): v for k, v in request.headers.items()})
        )

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics_text or vllm_metrics(model=self.model))

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _create(self, request: web.Request) -> web.Response:
        self._counter += 1
        # vLLM 0.32: the body's request_id (an extra field) becomes the response's id
        body = await request.json()
        rid = body.get("request_id") or f"resp_{self._counter:04d}"
        obj = {"id": rid, "object": "response", "status": "completed", "model": self.model, "output": []}
        if body.get("store", True) is not False:  # vLLM keeps only what it is asked to store
            self.stored[rid] = obj
        return web.json_response(obj)

    async def _get(self, request: web.Request) -> web.StreamResponse:
        obj = self.stored.get(request.match_info["rid"])
        if obj is None:
            return web.json_response({"error": {"message": "not found"}}, status=404)
        if self.get_mode == "hang":
            await asyncio.sleep(3600)
        if request.query.get("stream") == "true" and self.get_mode in ("sse-die", "sse-stall"):
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            event = {"type": "response.created", "sequence_number": 0, "response": obj}
            await resp.write(f"event: response.created\ndata: {json.dumps(event)}\n\n".encode())
            await asyncio.sleep(0.05 if self.get_mode == "sse-die" else 3600)
            assert request.transport is not None
            request.transport.abort()
            return resp
        resp = web.json_response(obj)
        if self.compress:
            resp.enable_compression()
        return resp

    async def _delete(self, request: web.Request) -> web.Response:
        obj = self.stored.pop(request.match_info["rid"], None)
        if obj is None:
            return web.json_response({"error": {"message": "not found"}}, status=404)
        return web.json_response({"id": obj["id"], "object": "response", "deleted": True})

    async def _other(self, request: web.Request) -> web.Response:
        return web.json_response({"reached": request.path, "method": request.method})


@contextlib.asynccontextmanager
async def running_replica(model: str = "tiny") -> AsyncIterator[Replica]:
    replica = Replica(model)
    await replica.start()
    try:
        yield replica
    finally:
        await replica.stop()
