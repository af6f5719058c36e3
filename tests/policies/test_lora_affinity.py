"""Scorer ``lora-affinity`` and LoRA adapters through the gateway (real simulators, real sockets)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from gateway.fleet.endpoint import EngineKind
from gateway.fleet.lora import LoraLoad, adapter_parents
from gateway.fleet.scraper import parse_engine_metrics
from gateway.prefix.hashing import block_hashes
from loadtest.simulator import SimConfig
from loadtest.simulator.server import start_runner
from tests.policies.helpers import endpoint, make_plugin, request, with_metrics
from tests.support.harness import debug_endpoints, wait_until

FAST_SCRAPE = {"interval_s": 0.05, "timeout_s": 0.5, "stale_after_s": 2.0}
LORA_POLICY = {
    "plugins": [
        {"type": "healthy"},
        {"type": "model"},
        {"type": "lora-affinity"},
        {"type": "in-flight"},
        {"type": "max-score"},
    ],
    "profiles": [
        {
            "name": "default",
            "plugins": [
                {"ref": "healthy"},
                {"ref": "model"},
                {"ref": "lora-affinity", "weight": 1},
                {"ref": "in-flight", "weight": 0.1},
                {"ref": "max-score"},
            ],
        }
    ],
}


def _adapter_endpoint(n: int, load: LoraLoad | None, stale: bool = False):
    e = with_metrics(endpoint(n, models=("base", "sql")), waiting=0, running=0, stale=stale)
    e.adapters = {"sql": "base"}
    e.metrics.lora = load
    return e


def test_levels_running_then_free_slot_then_waiting_then_evict():
    scorer = make_plugin("lora-affinity")
    running = _adapter_endpoint(1, LoraLoad(frozenset({"sql"}), frozenset(), 2))
    free = _adapter_endpoint(2, LoraLoad(frozenset({"x"}), frozenset(), 2))
    waiting = _adapter_endpoint(3, LoraLoad(frozenset({"x", "y"}), frozenset({"sql"}), 2))
    full = _adapter_endpoint(4, LoraLoad(frozenset({"x", "y"}), frozenset(), 2))
    unknown = _adapter_endpoint(5, None)
    stale = _adapter_endpoint(6, LoraLoad(frozenset({"sql"}), frozenset(), 2), stale=True)
    scores = scorer.score(request("sql"), [running, free, waiting, full, unknown, stale])
    assert scores == {running: 1.0, free: 0.8, waiting: 0.6, full: 0.0, unknown: 0.4, stale: 0.4}


def test_the_gateways_own_requests_in_flight_count_before_a_scrape():
    scorer = make_plugin("lora-affinity")
    never = _adapter_endpoint(1, None)  # no report yet
    never.adapters_in_flight = {"sql": 2}
    # Scraped with one free slot of two, but the gateway has another adapter in flight there.
    filled = _adapter_endpoint(2, LoraLoad(frozenset({"x"}), frozenset(), 2))
    filled.adapters_in_flight = {"y": 1}
    other = _adapter_endpoint(3, None)
    scores = scorer.score(request("sql"), [never, filled, other])
    assert scores == {never: 1.0, filled: 0.0, other: 0.4}


def test_a_waiting_adapter_counts_against_the_slots_once():
    # running {a}, waiting {a}: one adapter uses one of two slots, so another fits.
    load = LoraLoad(frozenset({"a"}), frozenset({"a"}), 2)
    assert load.has_free_slot()
    assert not LoraLoad(frozenset({"a"}), frozenset({"b"}), 2).has_free_slot()
    assert not LoraLoad(frozenset(), frozenset(), None).has_free_slot()


def test_a_base_model_request_is_neutral():
    scorer = make_plugin("lora-affinity")
    a = _adapter_endpoint(1, LoraLoad(frozenset({"sql"}), frozenset(), 1))
    b = _adapter_endpoint(2, LoraLoad(frozenset({"x"}), frozenset(), 1))
    assert scorer.score(request("base"), [a, b]) == {a: 1.0, b: 1.0}


def test_unknown_parameter_and_range_refused():
    with pytest.raises(Exception, match="unknown_score"):
        make_plugin("lora-affinity", {"unknown_score": 2})
    with pytest.raises(Exception, match="unknown parameter"):
        make_plugin("lora-affinity", {"weight": 1})


def test_scrape_takes_the_latest_label_set_and_survives_hostile_labels():
    text = (
        "# HELP vllm:lora_requests_info Running stats on lora requests.\n"
        "# TYPE vllm:lora_requests_info gauge\n"
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="a, b",waiting_lora_adapters=""} '
        "1.764e+09\n"
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="c",waiting_lora_adapters="d,,e"} '
        "1.765e+09\n"
        'vllm:lora_requests_info{max_lora="x",running_lora_adapters="z",waiting_lora_adapters=""} NaN\n'
    )
    load = parse_engine_metrics(text, EngineKind.VLLM).lora
    assert load == LoraLoad(frozenset({"c"}), frozenset({"d", "e"}), 4)
    bad = text.replace('max_lora="4"', 'max_lora="-3"')
    assert parse_engine_metrics(bad, EngineKind.VLLM).lora.max_lora is None
    huge = 'vllm:lora_requests_info{max_lora="1",running_lora_adapters="%s",waiting_lora_adapters=""} 1\n'
    many = parse_engine_metrics(huge % ",".join(f"a{i}" for i in range(20000)), EngineKind.VLLM).lora
    assert len(many.running) <= 4096
    assert parse_engine_metrics("vllm:num_requests_running 1\n", EngineKind.VLLM).lora is None


def test_adapter_parents_skips_malformed_entries():
    payload = {
        "data": [
            {"id": "base", "parent": None},
            {"id": "sql", "parent": "base"},
            {"id": "self", "parent": "self"},
            {"id": 3, "parent": "base"},
            "junk",
        ]
    }
    assert adapter_parents(payload) == {"sql": "base"}
    assert adapter_parents({"data": "x"}) == {} == adapter_parents([])


async def _complete(http: aiohttp.ClientSession, url: str, model: str, max_tokens: int = 4) -> Any:
    body = {"model": model, "prompt": f"{model} says hello " * 6, "max_tokens": max_tokens}
    async with http.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return resp.headers.get("x-gateway-endpoint")


async def test_gateway_lists_adapters_and_routes_to_the_replica_running_one(
    start_sim, start_gateway, http, openai_client
):
    sims = [
        await start_sim(enable_lora=True, max_loras=1, lora_modules=("a", "b"), time_scale=2.0)
        for _ in range(2)
    ]
    gw = await start_gateway([s.url for s in sims], scrape=FAST_SCRAPE, **LORA_POLICY)
    models = {m.id: m.model_extra.get("parent") for m in (await openai_client(gw).models.list()).data}
    assert models == {"sim-llama": None, "a": "sim-llama", "b": "sim-llama"}

    # Long requests straight to the replicas: sim 0 runs a, sim 1 runs b (each its one slot).
    holds = [
        asyncio.create_task(_complete(http, sims[0].url, "a", max_tokens=400)),
        asyncio.create_task(_complete(http, sims[1].url, "b", max_tokens=400)),
    ]

    async def scraped() -> bool:
        rows = await debug_endpoints(http, gw)
        lora = [rows[s.url]["lora"] for s in sims]
        return all(x is not None for x in lora) and [x["running"] for x in lora] == [["a"], ["b"]]

    await wait_until(scraped, 5.0, "both replicas' running adapters scraped")
    names = [s.url.split("://")[1] for s in sims]
    picks = [await _complete(http, gw.url, model, max_tokens=1) for model in ("a", "b", "a", "b")]
    assert picks == [names[0], names[1], names[0], names[1]]
    rows = await debug_endpoints(http, gw)
    assert rows[sims[0].url]["adapters"] == {"a": "sim-llama", "b": "sim-llama"}
    for hold in holds:
        hold.cancel()
    await asyncio.gather(*holds, return_exceptions=True)


async def test_default_preset_keeps_a_burst_per_adapter_on_one_replica(start_sim, start_gateway, http):
    # Two replicas with one adapter slot each; a and b arrive together, never scraped busy yet.
    sims = [
        await start_sim(enable_lora=True, max_loras=1, lora_modules=("a", "b"), time_scale=2.0)
        for _ in range(2)
    ]
    gw = await start_gateway([s.url for s in sims], scrape=FAST_SCRAPE)
    await _complete(http, gw.url, "a", max_tokens=30)
    models = ["b", "a"] * 4
    picks = await asyncio.gather(*(_complete(http, gw.url, m, max_tokens=30) for m in models))
    by_model = {m: {p for p, mm in zip(picks, models, strict=True) if mm == m} for m in ("a", "b")}
    assert len(by_model["a"]) == 1 and len(by_model["b"]) == 1, by_model
    rows = await debug_endpoints(http, gw)
    assert all(rows[s.url]["adapters_in_flight"] == {} for s in sims)  # every request settled


async def test_an_adapter_loaded_at_run_time_is_discovered_and_routed(start_sim, start_gateway, http):
    plain, lora = await start_sim(), await start_sim(enable_lora=True)
    gw = await start_gateway(
        [plain.url, lora.url], scrape=FAST_SCRAPE, health={"interval_s": 0.05, "models_refresh_s": 0.1}
    )
    async with http.post(gw.url + "/v1/completions", json={"model": "late", "prompt": "x"}) as resp:
        assert resp.status == 404  # nobody serves it yet
    body = {"lora_name": "late", "lora_path": "/adapters/late"}
    async with http.post(lora.url + "/v1/load_lora_adapter", json=body) as resp:
        assert resp.status == 200

    async def listed() -> bool:
        async with http.get(gw.url + "/v1/models") as resp:
            data = (await resp.json())["data"]
        return {"id": "late", "object": "model", "created": 0, "owned_by": "llm-gateway",
                "parent": "sim-llama"} in data  # fmt: skip

    await wait_until(listed, 5.0, "the adapter loaded at run time listed by the gateway")
    for _ in range(4):
        assert await _complete(http, gw.url, "late", max_tokens=1) == lora.url.split("://")[1]
    async with http.post(lora.url + "/v1/unload_lora_adapter", json={"lora_name": "late"}) as resp:
        assert resp.status == 200

    async def gone() -> bool:
        async with http.get(gw.url + "/v1/models") as resp:
            return "late" not in {m["id"] for m in (await resp.json())["data"]}

    await wait_until(gone, 5.0, "the unloaded adapter dropped from the gateway's list")


def test_adapters_are_in_the_prefix_keys():
    # The approximate index hashes the request's model first: an adapter's blocks are its own.
    prompt = "the same long shared prompt " * 40
    assert set(block_hashes("base", prompt)).isdisjoint(block_hashes("sql", prompt))
    assert block_hashes("sql", prompt) == block_hashes("sql", prompt)


async def test_a_model_is_listed_with_the_parent_that_a_healthy_replica_gives_it(
    start_sim, start_gateway, http
):
    """ "x" is a base model on one replica and an adapter of sim-llama on another: once the
    adapter's replica is down, "x" is listed as the base model it now only is."""
    base = await start_sim(model="x")
    runner, lora = await start_runner(SimConfig(port=0, enable_lora=True, lora_modules=("x",)))
    gw = await start_gateway(
        [base.url, lora.url],
        scrape=FAST_SCRAPE,
        health={"interval_s": 0.05, "timeout_s": 0.5, "unhealthy_threshold": 1, "models_refresh_s": 0.1},
    )

    async def parent_of_x() -> object:
        async with http.get(gw.url + "/v1/models") as resp:
            return next(m for m in (await resp.json())["data"] if m["id"] == "x").get("parent", "none")

    await wait_until(lambda: _equals(parent_of_x(), "sim-llama"), 5.0, "the adapter listed with its parent")
    gw.state.registry.get(lora.url).draining = True  # out of rotation, healthy: not a source either
    gw.state.registry.rebuild()
    assert await parent_of_x() == "none"
    gw.state.registry.get(lora.url).draining = False
    gw.state.registry.rebuild()
    assert await parent_of_x() == "sim-llama"
    await runner.cleanup()  # its replica goes down
    rows = lambda: debug_endpoints(http, gw)  # noqa: E731
    await wait_until(lambda: _down(rows(), lora.url), 5.0, "the adapter's replica marked down")
    assert await parent_of_x() == "none"


async def _equals(value: Any, expected: object) -> bool:
    return await value == expected


async def _down(rows: Any, url: str) -> bool:
    return not (await rows)[url]["healthy"]
