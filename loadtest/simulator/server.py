"""OpenAI-compatible HTTP front end of one simulated replica.

Speaks vLLM 0.32's wire format (chat and text completions, SSE streaming, usage with
cached_tokens, /v1/models, /health, /metrics; shapes in `wire`, checks in `validation`) plus
admin endpoints for fault injection and state inspection used by tests and benchmarks.
A client that disconnects has its request aborted so its KV blocks are freed. On shutdown
(SIGTERM) the listening socket closes first, then in-flight requests are ended with
``finish_reason: "abort"`` after ``shutdown_timeout_s`` (0: at once), as vLLM does.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import xxhash
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from loadtest.harness.ports import free_port

from .config import SimConfig
from .engine import FINISHED, Engine, EngineStopped, RequestTooLong, SimRequest
from .metrics import PDCounters, SimMetrics
from .pd import REGISTRY, PrefillRecord, prompt_digest
from .validation import Rejected, parse_body, parse_request
from .wire import SSE_CONTENT_TYPE, ChunkWriter, completion_body, error_response, json_response, models_body
from .wire import usage as usage_body

# no_transfer: a P/D prefill replica answers but hands over no KV (no kv_transfer_params, no room)
FAULT_MODES = ("none", "error", "hang", "drop", "slow", "no_transfer")


@dataclass
class Fault:
    mode: str = "none"
    status: int = 500
    after_chunks: int = 0
    slow_factor: float = 1.0


class _Disconnected(Exception):
    """The client went away."""


@dataclass
class SimState:
    config: SimConfig
    engine: Engine
    metrics: SimMetrics
    pd: PDCounters
    engine_id: str
    fault: Fault = field(default_factory=Fault)
    port: int = 0
    client: aiohttp.ClientSession | None = None  # P/D: claims KV from prefill replicas in other processes


STATE_KEY = web.AppKey("sim_state", SimState)
__all__ = ["RunningSimulator", "build_app", "error_response", "running_simulator", "start_runner"]


def _closed(request: web.Request) -> bool:
    t = request.transport
    return t is None or t.is_closing()


async def _next_event(req: SimRequest, request: web.Request) -> str | None:
    """Next token (or None at the end), noticing a vanished client even while queued.

    Checked here as well as by aiohttp's handler cancellation, so apps served by
    runners without `handler_cancellation=True` still free the blocks of gone clients.
    """
    if _closed(request):
        raise _Disconnected
    if not req.out.empty():
        return req.out.get_nowait()
    while True:
        try:
            return await asyncio.wait_for(req.out.get(), 0.25)
        except TimeoutError:
            if _closed(request):
                raise _Disconnected from None


async def _wait_disconnect(request: web.Request) -> None:
    while True:
        if _closed(request):
            return
        await asyncio.sleep(0.05)


class _Handlers:
    def __init__(self, state: SimState) -> None:
        self.s = state

    # ---- plain endpoints ------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        return json_response(models_body(self.s.config))

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.s.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def admin_state(self, request: web.Request) -> web.Response:
        st = self.s.engine.state()
        f = self.s.fault
        st.update(
            engine=self.s.config.engine,
            role=self.s.config.role,
            model=self.s.config.model,
            engine_id=self.s.engine_id,
            fault={
                "mode": f.mode,
                "status": f.status,
                "after_chunks": f.after_chunks,
                "slow_factor": f.slow_factor,
            },
            pd_transfers={"honoured": self.s.pd.honoured, "recomputed": self.s.pd.recomputed},
        )
        return web.json_response(st)

    async def admin_fault(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError
            mode = body.get("mode", "none")
            if mode not in FAULT_MODES:
                raise ValueError
            fault = Fault(
                mode=mode,
                status=int(body.get("status", 500)),
                after_chunks=int(body.get("after_chunks", 0)),
                slow_factor=float(body.get("slow_factor", 1.0)),
            )
        except (ValueError, TypeError):
            return error_response(
                400, f"body must be {{'mode': one of {FAULT_MODES}, ...}}", "BadRequestError"
            )
        self.s.fault = fault
        self.s.engine.slow_factor = fault.slow_factor if mode == "slow" else 1.0
        return web.json_response({"ok": True, "mode": mode})

    # ---- generation -------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        cfg = self.s.config
        try:
            parsed = parse_request(parse_body(await request.read()), chat, cfg)
        except Rejected as e:
            return e.response
        body, tokens = parsed.body, parsed.tokens

        fault = self.s.fault
        if fault.mode == "error":
            return error_response(fault.status, "injected fault", "InternalServerError")
        if fault.mode == "hang":
            await _wait_disconnect(request)
            raise asyncio.CancelledError  # nobody is listening any more
        if fault.mode == "drop" and not parsed.stream:
            if request.transport is not None:
                request.transport.close()
            raise asyncio.CancelledError

        external, pd_kind, room = await self._pd_prepare(body, tokens)
        seed = xxhash.xxh32_intdigest(b"".join(t.to_bytes(4, "little") for t in tokens[-64:]), seed=cfg.seed)
        if isinstance(body.get("seed"), int):
            seed ^= body["seed"] & 0xFFFFFFFF
        # vLLM 0.32 takes `priority` whatever the policy; only the priority scheduler reads it.
        req = SimRequest(
            tokens, parsed.max_tokens, seed=seed, external_tokens=external, priority=parsed.priority
        )
        try:
            self.s.engine.add_request(req)
        except EngineStopped as e:
            return error_response(503, str(e), "ServiceUnavailableError")
        except (RequestTooLong, ValueError) as e:  # a KV cache smaller than max_model_len: sim only
            return error_response(400, str(e), "BadRequestError", "max_tokens")
        try:
            if parsed.stream:
                return await self._stream(request, req, chat, parsed.include_usage)
            return await self._complete(request, req, chat, pd_kind, room)
        except (_Disconnected, ConnectionError):
            raise asyncio.CancelledError from None
        finally:
            if req.status != FINISHED:
                self.s.engine.abort(req)

    def _usage(self, req: SimRequest, chat: bool, streaming: bool) -> dict[str, Any]:
        return usage_body(
            req.num_prompt_tokens,
            req.num_output_tokens,
            max(0, req.num_cached_tokens),
            req.num_created_cache_tokens,
            chat=chat,
            streaming=streaming,
        )

    async def _complete(
        self, request: web.Request, req: SimRequest, chat: bool, pd_kind: str, room: Any
    ) -> web.Response:
        parts: list[str] = []
        while (ev := await _next_event(req, request)) is not None:
            parts.append(ev)
        if req.status != FINISHED:
            raise _Disconnected
        kv_params = self._pd_finish(req, pd_kind, room)
        use = self._usage(req, chat, streaming=False)
        return json_response(
            completion_body(self.s.config, "".join(parts), req.finish_reason, use, kv_params, chat)
        )

    async def _stream(
        self, request: web.Request, req: SimRequest, chat: bool, include_usage: bool
    ) -> web.StreamResponse:
        # vLLM (uvicorn) sends no Cache-Control and no Connection header on its streams.
        resp = web.StreamResponse(headers={"Content-Type": SSE_CONTENT_TYPE})
        await resp.prepare(request)
        chunks = ChunkWriter(self.s.config, chat)
        fault = self.s.fault
        drop_after = fault.after_chunks if fault.mode == "drop" else -1
        sent = 0

        async def send(payload: str) -> None:
            nonlocal sent
            if sent == drop_after:
                if request.transport is not None:
                    request.transport.close()
                raise _Disconnected
            await resp.write(f"data: {payload}\n\n".encode())
            sent += 1

        if chat:
            await send(chunks.role())
        finished = False
        ev = await _next_event(req, request)
        while ev is not None:
            nxt = await _next_event(req, request)
            finished = nxt is None and req.status == FINISHED
            finish = req.finish_reason if finished else None
            await send(chunks.token(ev, finish, last=finished and not include_usage))
            ev = nxt
        if req.status != FINISHED:
            raise _Disconnected
        if not finished:  # ended with no token pending (an abort at shutdown): close the choice
            await send(chunks.token("", req.finish_reason, last=not include_usage))
        if include_usage:
            await send(chunks.usage(self._usage(req, chat, streaming=True)))
        await send("[DONE]")
        await resp.write_eof()
        return resp

    # ---- P/D ---------------------------------------------------------------------
    async def _pd_prepare(self, body: dict[str, Any], tokens: list[int]) -> tuple[int, str, Any]:
        """Decide how many prompt tokens arrive by KV transfer. Returns (external tokens, kind, room)."""
        cfg = self.s.config
        params = body.get("kv_transfer_params")
        room = body.get("bootstrap_room")
        if isinstance(params, dict):
            if params.get("do_remote_decode"):
                return 0, "nixl_prefill", None
            if params.get("do_remote_prefill"):
                ok = await self._claim_nixl(params, tokens)
                return self._count(ok, tokens), "nixl_decode", None
        if room is not None and cfg.role in ("prefill", "decode"):
            if cfg.role == "prefill":
                return 0, "room_prefill", room
            ok = await self._claim_room(body, room, prompt_digest(tokens))
            return self._count(ok, tokens), "room_decode", room
        return 0, "", None

    async def _claim_nixl(self, params: dict[str, Any], tokens: list[int]) -> bool:
        """Same-process prefill: the shared registry; otherwise ask the replica at remote_host:remote_port."""
        engine_id = params.get("remote_engine_id")
        if engine_id in REGISTRY.engines:
            return REGISTRY.claim_nixl(params, tokens)
        host, port = params.get("remote_host"), params.get("remote_port")
        if not isinstance(host, str) or not isinstance(port, int) or self.s.client is None:
            return False
        claim = {
            "engine_id": engine_id,
            "request_id": params.get("remote_request_id"),
            "block_ids": params.get("remote_block_ids"),
            "digest": prompt_digest(tokens),
        }
        try:
            async with self.s.client.post(
                f"http://{host}:{port}/internal/pd/claim", json=claim, timeout=aiohttp.ClientTimeout(total=5)
            ) as r:
                return r.status == 200 and (await r.json()).get("ok") is True
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return False

    async def _claim_room(self, body: dict[str, Any], room: Any, digest: int) -> bool:
        """Wait (bounded) for the room's prefill: in this process's registry, or long-polling the
        bootstrap server the body names (the prefill replica's HTTP port)."""
        cfg = self.s.config
        deadline = time.monotonic() + max(0.2, 5.0 / cfg.time_scale)
        host, port = body.get("bootstrap_host"), body.get("bootstrap_port")
        remote = None
        if (
            isinstance(host, str)
            and isinstance(port, int)
            and port != self.s.port
            and self.s.client is not None
        ):
            remote = f"http://{host}:{port}/internal/pd/room/{room}"
        while True:
            rec = REGISTRY.take_room(room)
            if rec is not None:
                return rec.digest == digest
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if remote is None:
                rec = await REGISTRY.wait_room(room, min(remaining, 0.05))
                if rec is not None:
                    return rec.digest == digest
                continue
            status = await self._poll_room(remote, digest, min(remaining, 0.25))
            if status in ("honoured", "mismatch"):
                return status == "honoured"
            if status is None:  # no bootstrap server there (e.g. same-process sims): registry only
                remote = None

    async def _poll_room(self, url: str, digest: int, wait_s: float) -> str | None:
        assert self.s.client is not None
        try:
            async with self.s.client.get(
                url,
                params={"digest": str(digest), "wait_s": f"{wait_s:.3f}"},
                timeout=aiohttp.ClientTimeout(total=wait_s + 2.0),
            ) as r:
                if r.status != 200:
                    return None
                return str((await r.json()).get("status"))
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    # Served by every replica; only its own prefills answer.
    async def pd_claim(self, request: web.Request) -> web.Response:
        """vLLM-style pull: one-shot claim of a prefill this replica made."""
        try:
            c = await request.json()
            if not isinstance(c, dict):
                raise ValueError
        except (ValueError, UnicodeDecodeError):
            return error_response(400, "body must be a JSON object", "BadRequestError")
        if c.get("engine_id") != self.s.engine_id:
            return web.json_response({"ok": False, "reason": "unknown engine"})
        ok = REGISTRY.claim(c.get("engine_id"), c.get("request_id"), c.get("block_ids"), c.get("digest"))
        return web.json_response({"ok": ok})

    async def pd_room(self, request: web.Request) -> web.Response:
        """SGLang-style bootstrap server: long-poll for a room this replica prefilled; consumes it."""
        try:
            room = int(request.match_info["room"])
            digest = int(request.query["digest"])
            wait_s = min(30.0, max(0.0, float(request.query.get("wait_s", "0"))))
        except (KeyError, ValueError):
            return error_response(400, "need an integer room and ?digest=N[&wait_s=S]", "BadRequestError")
        rec = await REGISTRY.wait_room(room, wait_s, engine_id=self.s.engine_id)
        if rec is None:
            return web.json_response({"status": "absent"})
        return web.json_response({"status": "honoured" if rec.digest == digest else "mismatch"})

    def _count(self, ok: bool, tokens: list[int]) -> int:
        if ok:
            self.s.pd.honoured += 1
            return len(tokens) - 1
        self.s.pd.recomputed += 1
        return 0

    def _pd_finish(self, req: SimRequest, kind: str, room: Any) -> dict[str, Any] | None:
        if kind not in ("nixl_prefill", "room_prefill") or self.s.fault.mode == "no_transfer":
            return None
        if req.finish_reason == "abort":  # ended by shutdown: no KV worth handing over
            return None
        cfg = self.s.config
        rec = PrefillRecord(
            engine_id=self.s.engine_id,
            request_id=req.request_id,
            block_ids=list(req.last_block_ids),
            digest=prompt_digest(req.prompt_tokens),
            num_tokens=req.num_prompt_tokens,
            expires=time.monotonic() + cfg.pd_ttl_s,
        )
        REGISTRY.add_prefill(rec, room=room if kind == "room_prefill" else None)
        if kind == "room_prefill":
            return None
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.s.engine_id,
            "remote_block_ids": rec.block_ids,
            "remote_host": cfg.host,
            "remote_port": self.s.port or cfg.port,
            "remote_request_id": req.request_id,
            "tp_size": 1,
        }


def build_app(config: SimConfig) -> web.Application:
    """The aiohttp application of one simulated replica; the engine runs while the app runs."""
    engine = Engine(config)
    pd = PDCounters()
    state = SimState(
        config=config,
        engine=engine,
        metrics=SimMetrics(engine, pd),
        pd=pd,
        engine_id=f"sim-{uuid.uuid4().hex[:12]}",
        port=config.port,
    )
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[STATE_KEY] = state
    h = _Handlers(state)
    app.router.add_post("/v1/chat/completions", h.chat)
    app.router.add_post("/v1/completions", h.completions)
    app.router.add_get("/v1/models", h.models)
    app.router.add_get("/health", h.health)
    app.router.add_get("/metrics", h.metrics)
    app.router.add_get("/admin/state", h.admin_state)
    app.router.add_post("/admin/fault", h.admin_fault)
    app.router.add_post("/internal/pd/claim", h.pd_claim)
    app.router.add_get("/internal/pd/room/{room}", h.pd_room)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        REGISTRY.engines.add(state.engine_id)
        state.client = aiohttp.ClientSession()
        engine.start()
        yield
        REGISTRY.engines.discard(state.engine_id)
        await engine.stop()
        if state.client is not None:
            await state.client.close()

    app.cleanup_ctx.append(lifecycle)

    async def end_in_flight(app: web.Application) -> None:
        """Runs once the sites are closed (new connections already refused), before aiohttp
        waits for the handlers: let in-flight requests run for shutdown_timeout_s, then end
        the rest with finish_reason "abort" so every client gets its answer at once."""
        engine.close_admission()
        await engine.drain(config.shutdown_timeout_s)
        await engine.shutdown()

    app.on_shutdown.append(end_in_flight)
    return app


@dataclass
class RunningSimulator:
    """Handle on a simulator started by `running_simulator`."""

    url: str
    engine: Engine
    config: SimConfig
    app: web.Application

    @property
    def state(self) -> SimState:
        return self.app[STATE_KEY]


_HANDLER_GRACE_S = 5.0


async def start_runner(config: SimConfig) -> tuple[web.AppRunner, RunningSimulator]:
    """Start a simulator on config.host (a free port if config.port == 0)."""
    if config.port == 0:
        config.port = free_port(config.host)
    app = build_app(config)
    # Handlers still running this long after the engine ended their requests (a client that
    # stopped reading, a hung fault) are cancelled: shutdown stays bounded.
    grace = config.shutdown_timeout_s + _HANDLER_GRACE_S
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=grace)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, reuse_address=True)
    await site.start()
    app[STATE_KEY].port = config.port
    sim = RunningSimulator(
        url=f"http://{config.host}:{config.port}", engine=app[STATE_KEY].engine, config=config, app=app
    )
    return runner, sim


@contextlib.asynccontextmanager
async def running_simulator(
    config: SimConfig | None = None, **overrides: Any
) -> AsyncIterator[RunningSimulator]:
    """`async with running_simulator(SimConfig(port=0)) as sim:` -> sim.url, sim.engine, sim.config."""
    if config is None:
        config = SimConfig(port=0, **overrides)
    elif overrides:
        from dataclasses import replace

        config = replace(config, **overrides)
    runner, sim = await start_runner(config)
    try:
        yield sim
    finally:
        await runner.cleanup()
