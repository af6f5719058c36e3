"""Model aliases and weighted traffic splits (config ``models:``), on real sockets.

Two upstreams serve two model versions (``v1``, ``v2``); clients ask for aliases. The
engine must see the target in the body, /v1/models lists the aliases, the split follows
its weights (per-target counters), a session keeps one target, a target without a
healthy endpoint is skipped, and a config reload moves the weights under load.
"""

from __future__ import annotations

import asyncio
import collections

import pytest
import yaml

from gateway.admission.aliases import Split
from gateway.config import ConfigError, WeightedTarget, load_config
from gateway.http.reload import ConfigReloader
from tests.support.harness import chat_body, gateway_metrics, metric_value

STICKY_HEALTH = {"interval_s": 60, "unhealthy_threshold": 100}
SPLIT = [{"model": "v1", "weight": 90}, {"model": "v2", "weight": 10}]


@pytest.fixture
async def fleet(start_upstream):
    return await start_upstream(models=("v1",)), await start_upstream(models=("v2",))


async def _ask(http, gw, model: str, **extra) -> tuple[int, str | None, dict]:
    async with http.post(gw.url + "/v1/chat/completions", json=chat_body(model), **extra) as resp:
        return resp.status, resp.headers.get("x-gateway-model"), await resp.json()


async def test_an_alias_rewrites_the_body_and_is_listed(fleet, start_gateway, http):
    v1, v2 = fleet
    gw = await start_gateway([v1.url, v2.url], models={"chat": "v1"})
    status, target, body = await _ask(http, gw, "chat")
    assert status == 200 and target == "v1" and body["model"] == "v1"
    assert v1.requests[-1].json["model"] == "v1" and not v2.requests  # the engine sees its own name
    assert v1.requests[-1].json["messages"] == chat_body()["messages"]  # the rest of the body kept
    status, target, _ = await _ask(http, gw, "v2")  # a served model is not an alias: untouched
    assert status == 200 and target is None and v2.requests[-1].json["model"] == "v2"
    async with http.get(gw.url + "/v1/models") as resp:
        assert sorted(m["id"] for m in (await resp.json())["data"]) == ["chat", "v1", "v2"]


async def test_an_alias_to_a_model_nobody_serves_is_not_listed_and_is_a_404(fleet, start_gateway, http):
    v1, _ = fleet
    gw = await start_gateway([v1.url], models={"ghost": "v9", "chat": "v1"})
    async with http.get(gw.url + "/v1/models") as resp:
        assert sorted(m["id"] for m in (await resp.json())["data"]) == ["chat", "v1"]
    status, _, body = await _ask(http, gw, "ghost")
    assert status == 404 and "v9" in body["error"]["message"]


async def test_a_weighted_split_follows_its_weights_with_per_target_counters(fleet, start_gateway, http):
    v1, v2 = fleet
    gw = await start_gateway([v1.url, v2.url], models={"chat": SPLIT})
    n = 400
    seen = collections.Counter()
    for _ in range(n):
        status, target, _ = await _ask(http, gw, "chat")
        assert status == 200
        seen[target] += 1
    assert len(v1.requests) == seen["v1"] and len(v2.requests) == seen["v2"]
    assert 0.04 * n < seen["v2"] < 0.18 * n, seen  # 10 % ± a wide binomial margin (sd 1.5 %)
    text = await gateway_metrics(http, gw)
    for model in ("v1", "v2"):
        assert (
            metric_value(text, "llm_gateway_model_alias_requests_total", alias="chat", target=model)
            == seen[model]
        )
        assert metric_value(text, "llm_gateway_requests_total", model=model) == seen[model]  # per target


async def test_a_session_keeps_one_target(fleet, start_gateway, http):
    v1, v2 = fleet
    gw = await start_gateway([v1.url, v2.url], models={"chat": [{"model": "v1"}, {"model": "v2"}]})
    targets = collections.defaultdict(set)
    for session in range(12):
        for _ in range(4):
            status, target, _ = await _ask(
                http, gw, "chat", headers={"x-session-id": f"conversation-{session}"}
            )
            assert status == 200
            targets[session].add(target)
    assert all(len(t) == 1 for t in targets.values()), targets  # never flips mid-conversation
    assert {next(iter(t)) for t in targets.values()} == {"v1", "v2"}  # yet both targets get sessions


async def test_a_target_without_a_healthy_endpoint_is_skipped(fleet, start_gateway, http):
    v1, v2 = fleet
    gw = await start_gateway(
        [v1.url, v2.url], models={"chat": [{"model": "v1", "weight": 1}, {"model": "v2", "weight": 99}]}
    )
    await v2.stop()
    endpoint = next(e for e in gw.state.registry if e.name == v2.name)
    while gw.state.registry.candidates("v2"):  # connection refused, as the proxy would report it
        gw.state.health.mark_failed(endpoint)
    for _ in range(10):
        status, target, body = await _ask(http, gw, "chat")
        assert status == 200 and target == "v1", (status, target, body)


def test_bad_models_sections_are_rejected_with_the_key():
    def load(models):
        return load_config(
            overrides={"endpoints": [{"url": "http://127.0.0.1:9"}], "models": models}, environ={}
        )

    for models, why in [
        ({"a": "b", "b": "c"}, "aliases do not chain"),
        ({"a": "a"}, "may not target itself"),
        ({"a": [{"model": "x", "weight": 0}]}, "every weight is 0"),
        ({"a": [{"model": "x"}, {"model": "x"}]}, "listed twice"),
        ({"a": []}, "give a target"),
        ({"a": [{"model": "x", "weight": -1}]}, "models.a"),
    ]:
        with pytest.raises(ConfigError, match="models") as caught:
            load(models)
        assert why in str(caught.value), (models, str(caught.value))


def test_split_pick_points_and_zero_weights():
    split = Split(
        [
            WeightedTarget(model="a", weight=3),
            WeightedTarget(model="off", weight=0),
            WeightedTarget(model="b", weight=1),
        ]
    )
    assert split.models == ["a", "b"]
    assert [split.pick(p, lambda m: True) for p in (0.0, 0.5, 0.74, 0.76, 0.999)] == ["a", "a", "a", "b", "b"]
    assert split.pick(0.9, lambda m: m != "b") == "a"  # b cannot serve: a takes it
    assert split.pick(0.9, lambda m: False) == "b"  # nobody can: the drawn one (its 503 says why)


async def test_a_reload_moves_the_weights_under_load(fleet, start_gateway, http, tmp_path):
    v1, v2 = fleet
    urls = [v1.url, v2.url]
    gw = await start_gateway(
        urls, models={"chat": [{"model": "v1", "weight": 100}, {"model": "v2", "weight": 0}]}
    )
    path = tmp_path / "gw.yaml"

    def write(v1_weight: int, v2_weight: int) -> None:
        split = [{"model": "v1", "weight": v1_weight}, {"model": "v2", "weight": v2_weight}]
        path.write_text(
            yaml.safe_dump(
                {"endpoints": [{"url": u} for u in urls], "models": {"chat": split}, "health": STICKY_HEALTH}
            )
        )

    write(100, 0)
    reloader = ConfigReloader(gw.state, path)
    results: list[tuple[float, int, str | None]] = []
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    async def client() -> None:
        while not stop.is_set():
            status, target, _ = await _ask(http, gw, "chat")
            results.append((loop.time(), status, target))

    clients = [asyncio.create_task(client()) for _ in range(8)]
    await asyncio.sleep(0.5)
    write(0, 100)
    assert await reloader.reload() == "applied"
    switched = loop.time()
    await asyncio.sleep(0.5)
    write(50, 50)
    assert await reloader.reload() == "applied"
    halved = loop.time()
    await asyncio.sleep(1.0)
    stop.set()
    await asyncio.gather(*clients)

    assert results and all(status == 200 for _, status, _ in results)  # no request lost to the reloads
    before = [t for at, _, t in results if at < switched - 0.05]
    between = [t for at, _, t in results if switched + 0.05 < at < halved - 0.05]
    after = [t for at, _, t in results if at > halved + 0.05]
    assert before and set(before) == {"v1"}
    assert between and set(between) == {"v2"}
    assert len(after) > 40 and 0.25 < after.count("v1") / len(after) < 0.75
    async with http.get(gw.url + "/v1/models") as resp:
        assert "chat" in {m["id"] for m in (await resp.json())["data"]}
