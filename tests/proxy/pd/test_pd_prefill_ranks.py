"""A failed prefill leg is re-sent to another prefill server before another rank of the same one.

Found by review (2026-12-05): the prefill retry took the ranked targets in order, so a prefill
server with two data-parallel ranks that answered 503 got both tries, the healthy (slightly
busier) prefill server none, and the request was served decode-only.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from aiohttp import web

from tests.support.harness import metric_value, running_gateway, wait_until

TRANSFER = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e1",
            "remote_block_ids": [1], "remote_host": "127.0.0.1", "remote_port": 5600}  # fmt: skip
Answer = Callable[[dict], Awaitable[web.Response]]

# The P/D preset with the engine's queue in the prefill profile: a prefill server that reports a
# queue ranks after an idle one's ranks, so the order is known (the preset's is a random tie).
_QUEUE_RANKED_PD = {
    "pd": {"protocol": "vllm", "decider": "always"},
    "plugins": [
        {"type": "healthy"},
        {"type": "model"},
        {"type": "role", "name": "decode-pool", "parameters": {"roles": ["decode", "both"]}},
        {"type": "role", "name": "prefill-pool", "parameters": {"roles": ["prefill"]}},
        {"type": "queue-depth"},
        {"type": "max-score"},
        {"type": "pd-disagg", "parameters": {"decider": "always"}},
    ],
    "profiles": [
        {"name": "decode", "plugins": [{"ref": "healthy"}, {"ref": "model"}, {"ref": "decode-pool"},
                                       {"ref": "max-score"}]},
        {"name": "prefill", "plugins": [{"ref": "healthy"}, {"ref": "model"}, {"ref": "prefill-pool"},
                                        {"ref": "queue-depth", "weight": 1}, {"ref": "max-score"}]},
    ],
}  # fmt: skip


def _page(ranks: list[int], waiting: float) -> str:
    lines = []
    gauges = (("num_requests_running", 0.0), ("num_requests_waiting", waiting), ("kv_cache_usage_perc", 0.0))
    for family, value in gauges:
        lines.append(f"# TYPE vllm:{family} gauge")
        lines += [f'vllm:{family}{{engine="{r}",model_name="tiny"}} {value}' for r in ranks]
    return "\n".join(lines) + "\n"


def _completion(**extra: object) -> web.Response:
    choice = {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    body = {"id": "x", "object": "chat.completion", "model": "tiny", "choices": [choice], "usage": usage}
    return web.json_response({**body, **extra})


@contextlib.asynccontextmanager
async def _server(
    name: str, calls: list[tuple[str, str | None]], answer: Answer, page: str | Callable[[], str]
) -> AsyncIterator[str]:
    async def chat(request: web.Request) -> web.Response:
        calls.append((name, request.headers.get("x-data-parallel-rank")))
        return await answer(await request.json())

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=page if isinstance(page, str) else page(), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/health", _ok)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def _ok(request: web.Request) -> web.Response:
    return web.Response()


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})


async def test_a_failed_prefill_goes_to_another_prefill_server_not_another_rank_of_it() -> None:
    calls: list[tuple[str, str | None]] = []

    async def dead(body: dict) -> web.Response:
        return web.json_response({"error": {"message": "engine dead"}}, status=503)

    async def prefill(body: dict) -> web.Response:
        return _completion(kv_transfer_params=TRANSFER)

    async def decode(body: dict) -> web.Response:
        return _completion()

    async with (
        _server("P", calls, dead, _page([0, 1], 0.0)) as p,
        _server("Q", calls, prefill, _page([0], 3.0)) as q,
        _server("D", calls, decode, _page([0], 0.0)) as d,
    ):
        fleet = [
            {"url": p, "role": "prefill", "engine": "vllm", "models": ["tiny"], "data_parallel_size": 2},
            {"url": q, "role": "prefill", "engine": "vllm", "models": ["tiny"]},
            {"url": d, "role": "decode", "engine": "vllm", "models": ["tiny"]},
        ]
        async with (
            running_gateway(fleet, resilience={"retry_backoff_s": 0.0}, **_QUEUE_RANKED_PD) as gw,
            aiohttp.ClientSession() as http,
        ):

            async def scraped() -> bool:
                return all(e.metrics.scraped_at > 0 for e in gw.state.registry)

            await wait_until(scraped, 3.0, "every replica scraped: Q's queue ranks it after P's ranks")
            body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
            async with http.post(gw.url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
        assert [server for server, _ in calls] == ["P", "Q", "D"], calls  # never P's other rank


async def test_a_prefill_server_restarted_with_fewer_ranks_is_asked_again_without_the_header() -> None:
    """Restarted with one rank of four between two scrapes: a prefill leg sent to a gone rank
    gets vLLM's 400; the same server is asked again without the header, its ranks drop and are
    learned again at once, and no request falls back to decode-only."""
    calls: list[tuple[str, str | None]] = []
    ranks = {"P": 4}

    async def prefill(body: dict) -> web.Response:
        rank = calls[-1][1]
        if rank is not None and int(rank) >= ranks["P"]:
            message = f"data_parallel_rank {rank} is out of range [0, {ranks['P']})."
            error = {"message": message, "type": "BadRequestError", "param": None, "code": 400}
            return web.json_response({"error": error}, status=400)
        return _completion(kv_transfer_params=TRANSFER)

    async def decode(body: dict) -> web.Response:
        return _completion()

    async with (
        _server("P", calls, prefill, lambda: _page(list(range(ranks["P"])), 0.0)) as p,
        _server("D", calls, decode, _page([0], 0.0)) as d,
    ):
        fleet = [
            {"url": p, "role": "prefill", "engine": "vllm", "models": ["tiny"]},
            {"url": d, "role": "decode", "engine": "vllm", "models": ["tiny"]},
        ]
        slow_watch = {"scrape": {"interval_s": 30.0}, "health": {"interval_s": 30.0}}
        async with (
            running_gateway(
                fleet, resilience={"retry_backoff_s": 0.0}, **slow_watch, **_QUEUE_RANKED_PD
            ) as gw,
            aiohttp.ClientSession() as http,
        ):

            async def ranks_of_p() -> list[str]:
                return [t.name for t in gw.state.registry.targets() if t.url == p]

            await wait_until(lambda: _length(ranks_of_p(), 4), 5.0, "P's four ranks learned")
            ranks["P"] = 1
            for i in range(8):
                body = {
                    "model": "tiny",
                    "messages": [{"role": "user", "content": f"hello {i}"}],
                    "max_tokens": 4,
                }
                async with http.post(gw.url + "/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200
            await wait_until(lambda: _length(ranks_of_p(), 1), 5.0, "P routed as one target again")
            text = await (await http.get(gw.url + "/metrics")).text()
        prefill_legs = [rank for server, rank in calls if server == "P"]
        assert len([r for r in prefill_legs if r not in (None, "0")]) <= 1, (
            prefill_legs
        )  # one refusal at most
        assert not metric_value(
            text, "llm_gateway_pd_decisions_total", mode="decode_only", reason="prefill_failed"
        )
        assert len([server for server, _ in calls if server == "D"]) == 8


async def _length(names: Awaitable[list[str]], n: int) -> bool:
    return len(await names) == n
