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
import errno
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import xxhash
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from loadtest.harness.ports import free_port

from .agent_http import AgentHandlers
from .config import SimConfig
from .dp import DataParallel, requested_rank
from .engine import FINISHED, Engine, EngineStopped, RequestTooLong, SimRequest
from .kv_events import KVEventPublisher
from .kv_http import KVHandlers
from .lora import LoraAdapters, LoraCollector
from .metrics import PDCounters, SimMetrics
from .pd import REGISTRY
from .pd_http import PDHandlers
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
    kv_events: KVEventPublisher | None = None  # with config.kv_events (rank 0's with DP)
    dp: DataParallel | None = None  # with config.data_parallel_size > 1; engines[0] is ``engine``
    lora: LoraAdapters | None = None  # with config.enable_lora


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


class _Handlers(PDHandlers, KVHandlers, AgentHandlers):
    def __init__(self, state: SimState) -> None:
        self.s = state

    # ---- plain endpoints ------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        body = models_body(self.s.config)
        if self.s.lora is not None:  # vLLM lists each adapter with its parent
            body["data"].extend(self.s.lora.cards(body["data"][0]["created"]))
        return json_response(body)

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
        if self.s.dp is not None:
            st["data_parallel"] = self.s.dp.state()
        if self.s.lora is not None:
            st["lora"] = self.s.lora.stats()
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
            adapters = self.s.lora.modules if self.s.lora is not None else ()
            parsed = parse_request(parse_body(await request.read()), chat, cfg, adapters)
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
        if self.s.lora is not None:
            self.s.lora.assign(req, body.get("model"))
        if self.s.dp is None:
            refused = requested_rank(request, 1)
            engine = refused if isinstance(refused, web.Response) else self.s.engine
        else:
            engine = self.s.dp.pick(request)
        if isinstance(engine, web.Response):
            return engine  # a rank out of range
        try:
            engine.add_request(req)
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
                engine.abort(req)

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


def build_app(config: SimConfig) -> web.Application:
    """The aiohttp application of one simulated replica; the engine runs while the app runs."""
    engine = Engine(config)
    pd = PDCounters()
    dp = DataParallel.build(config, engine) if config.data_parallel_size > 1 else None
    state = SimState(
        config=config,
        engine=engine,
        metrics=SimMetrics(engine, pd, ranks=dp.engines if dp is not None else None),
        pd=pd,
        engine_id=f"sim-{uuid.uuid4().hex[:12]}",
        port=config.port,
        dp=dp,
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
    app.router.add_get("/kv_event_sources", h.kv_event_sources)
    app.router.add_post("/tokenize", h.tokenize)
    app.router.add_post("/reset_prefix_cache", h.reset_prefix_cache)
    h.add_agent_routes(app)
    if config.enable_lora:
        state.lora = LoraAdapters(config)
        for each in dp.engines if dp is not None else [engine]:
            state.lora.attach(each)
        state.metrics.registry.register(LoraCollector(state.lora))
        state.lora.routes(app)
    if config.kv_events and dp is not None:
        dp.publish(config)
        h.kv_publisher = state.kv_events = dp.publishers[0]
    elif config.kv_events:
        h.kv_publisher = state.kv_events = KVEventPublisher(
            engine.kv,
            host=config.host,
            port=config.kv_events_port,
            replay_port=config.kv_events_replay_port,
            topic=config.kv_events_topic,
        )
        engine.on_step = h.kv_publisher.flush

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        REGISTRY.engines.add(state.engine_id)
        state.client = aiohttp.ClientSession()
        engines = dp.engines if dp is not None else [engine]
        publishers = dp.publishers if dp is not None else [p for p in (state.kv_events,) if p is not None]
        for publisher in publishers:
            await publisher.start()
        for each in engines:
            each.start()
        yield
        for publisher in publishers:
            await publisher.close()
        REGISTRY.engines.discard(state.engine_id)
        for each in engines:
            await each.stop()
        if state.client is not None:
            await state.client.close()

    app.cleanup_ctx.append(lifecycle)

    async def end_in_flight(app: web.Application) -> None:
        """Runs once the sites are closed (new connections already refused), before aiohttp
        waits for the handlers: let in-flight requests run for shutdown_timeout_s, then end
        the rest with finish_reason "abort" so every client gets its answer at once."""
        engines = dp.engines if dp is not None else [engine]
        for each in engines:
            each.close_admission()
        await asyncio.gather(*(each.drain(config.shutdown_timeout_s) for each in engines))
        for each in engines:
            await each.shutdown()

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
_PORT_TRIES = 5


async def start_runner(config: SimConfig) -> tuple[web.AppRunner, RunningSimulator]:
    """Start a simulator on config.host (a free port if config.port == 0).

    A free port is found, then bound: another process can take it in between (CI saw it), so a
    port chosen here is chosen again, up to ``_PORT_TRIES`` times, when its bind fails."""
    choose = config.port == 0
    grace = config.shutdown_timeout_s + _HANDLER_GRACE_S
    for attempt in range(1, _PORT_TRIES + 1):
        if choose:
            config.port = free_port(config.host)
        app = build_app(config)
        # Handlers still running this long after the engine ended their requests (a client that
        # stopped reading, a hung fault) are cancelled: shutdown stays bounded.
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=grace)
        await runner.setup()
        site = web.TCPSite(runner, config.host, config.port, reuse_address=True)
        try:
            await site.start()
            break
        except OSError as exc:
            await runner.cleanup()
            if not choose or exc.errno != errno.EADDRINUSE or attempt == _PORT_TRIES:
                raise
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
