"""The simulator's LoRA serving over real sockets: /v1/models, the slots limit, load cost, the metric."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai

from gateway.fleet.endpoint import EngineKind
from gateway.fleet.kv_wire import BlockStored, decode_batch
from gateway.fleet.scraper import parse_engine_metrics
from loadtest.simulator import SimConfig, running_simulator
from tests.loadtest.test_simulator_kv_events import subscribed

BASE = "sim-llama"


def cfg(**kw: Any) -> SimConfig:
    kw.setdefault("time_scale", 20.0)
    return SimConfig(port=0, enable_lora=True, **kw)


async def _complete(s: aiohttp.ClientSession, url: str, model: str, max_tokens: int = 4) -> dict[str, Any]:
    body = {"model": model, "prompt": f"hello from {model} " * 8, "max_tokens": max_tokens}
    async with s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def _state(s: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with s.get(url + "/admin/state") as r:
        return (await r.json())["lora"]


async def test_models_list_adapters_with_their_parent_and_the_sdk_uses_them():
    async with running_simulator(cfg(lora_modules=("sql=/adapters/sql", "chat"))) as sim:
        client = openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0)
        try:
            models = {m.id: m for m in (await client.models.list()).data}
            assert set(models) == {BASE, "sql", "chat"}
            assert models["sql"].model_extra["parent"] == BASE
            assert models["sql"].model_extra["root"] == "/adapters/sql"
            assert models[BASE].model_extra["parent"] is None
            done = await client.completions.create(model="sql", prompt="select", max_tokens=3)
            assert done.usage.completion_tokens == 3
            try:
                await client.completions.create(model="nope", prompt="x", max_tokens=1)
                raise AssertionError("an unknown adapter must be a 404")
            except openai.NotFoundError:
                pass
        finally:
            await client.close()


async def test_adapters_loaded_and_unloaded_at_run_time():
    async with running_simulator(cfg()) as sim, aiohttp.ClientSession() as s:
        load = {"lora_name": "new", "lora_path": "/a/new"}
        async with s.post(sim.url + "/v1/load_lora_adapter", json=load) as r:
            assert r.status == 200 and "added successfully" in await r.text()
        async with s.post(sim.url + "/v1/load_lora_adapter", json=load) as r:
            assert r.status == 400  # already loaded
        async with s.post(sim.url + "/v1/load_lora_adapter", json={"lora_name": "x"}) as r:
            assert r.status == 400  # no path
        await _complete(s, sim.url, "new")
        async with s.post(sim.url + "/v1/unload_lora_adapter", json={"lora_name": "new"}) as r:
            assert r.status == 200
        async with s.post(sim.url + "/v1/unload_lora_adapter", json={"lora_name": "new"}) as r:
            assert r.status == 404
        async with s.get(sim.url + "/v1/models") as r:
            assert [m["id"] for m in (await r.json())["data"]] == [BASE]


async def test_max_loras_bounds_the_batch_and_swaps_cost_loads():
    # One slot: a, b, a, b one after another is four loads (each evicts the other); a, a, a is one.
    async with running_simulator(cfg(max_loras=1, lora_modules=("a", "b"), lora_load_ms=200)) as sim:
        async with aiohttp.ClientSession() as s:
            for model in ("a", "a", "a"):
                await _complete(s, sim.url, model)
            assert (await _state(s, sim.url))["loads"] == 1
            for model in ("b", "a", "b"):
                await _complete(s, sim.url, model)
            state = await _state(s, sim.url)
            assert state["loads"] == 4 and state["evictions"] == 3
            # Concurrent a and b with one slot: never both in one batch, so b waits for a.
            results = await asyncio.gather(
                _complete(s, sim.url, "a", max_tokens=20), _complete(s, sim.url, "b", max_tokens=2)
            )
            assert all(r["usage"]["completion_tokens"] in (20, 2) for r in results)


async def test_the_metric_names_running_and_waiting_adapters_and_the_gateway_parses_it():
    async with running_simulator(cfg(max_loras=1, lora_modules=("a", "b"), time_scale=2.0)) as sim:
        async with aiohttp.ClientSession() as s:
            long_a = asyncio.create_task(_complete(s, sim.url, "a", max_tokens=60))
            await asyncio.sleep(0.05)
            short_b = asyncio.create_task(_complete(s, sim.url, "b", max_tokens=1))
            seen = None
            for _ in range(100):
                async with s.get(sim.url + "/metrics") as r:
                    text = await r.text()
                load = parse_engine_metrics(text, EngineKind.VLLM).lora
                if load is not None and load.waiting:
                    seen = load
                    break
                await asyncio.sleep(0.02)
            assert seen is not None, "b never showed as waiting while a held the only slot"
            assert seen.running == {"a"} and seen.waiting == {"b"} and seen.max_lora == 1
            assert not seen.has_free_slot()
            await asyncio.gather(long_a, short_b)
            async with s.get(sim.url + "/metrics") as r:
                text = await r.text()
            # Old label sets stay exported (as vLLM's gauge): the latest wins, here b's run.
            assert text.count("vllm:lora_requests_info{") >= 2
            assert parse_engine_metrics(text, EngineKind.VLLM).lora.running <= {"b"}


async def test_prefix_cache_is_keyed_by_the_adapter():
    async with running_simulator(cfg(lora_modules=("a",), max_loras=2)) as sim:
        async with aiohttp.ClientSession() as s:
            body = {"prompt": "shared words " * 40, "max_tokens": 1}

            async def cached(model: str) -> int:
                async with s.post(sim.url + "/v1/completions", json={**body, "model": model}) as r:
                    usage = (await r.json())["usage"]
                    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)

            assert await cached(BASE) == 0
            assert await cached("a") == 0  # the base model's blocks are not the adapter's
            assert await cached("a") > 0
            assert await cached(BASE) > 0


async def _payloads(sub: Any, wait_s: float = 0.5) -> list[bytes]:
    out = []
    while True:
        try:
            _topic, _seq, payload = await asyncio.wait_for(sub.recv_multipart(), wait_s)
        except TimeoutError:
            return out
        out.append(payload)


async def test_kv_events_name_the_adapter_as_vllm_does():
    # Decoded by the gateway's own KV-event reader: an adapter's blocks carry its name (and it as
    # each block's extra key), the base model's none; never merged into one event.
    async with subscribed(enable_lora=True, lora_modules=("sql",)) as (sim, session, sub, _):
        for model in ("sql", BASE):
            await _complete(session, sim.url, model)
        events = [e for payload in await _payloads(sub) for e in decode_batch(payload)[1]]
        stored = [e for e in events if isinstance(e, BlockStored)]
        assert {e.lora_name for e in stored} == {"sql", None}
        for event in stored:
            expected = None if event.lora_name is None else ["sql"]
            assert event.extra_keys and all(k == expected for k in event.extra_keys)
