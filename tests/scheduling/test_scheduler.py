"""The scheduling framework: clamping, weights, sums, timing histograms, third-party plugins."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from gateway.config import ConfigError
from gateway.errors import NoHealthyEndpoint
from gateway.fleet.endpoint import Endpoint
from gateway.http.plugins import default_registry
from gateway.ops.metrics import GatewayMetrics
from gateway.request.types import InferenceRequest
from gateway.scheduling.framework import PluginKind
from gateway.scheduling.result import ScoredEndpoint
from gateway.scheduling.scheduler import PLUGIN_TIMING_EVERY, Profile, Scheduler, WeightedScorer
from tests.policies.helpers import endpoint, make_plugin, request
from tests.support.harness import chat_body

# Per-plugin scores are kept for requests that ask to see them (and for debug logging).
DEBUG = {"x-gateway-debug": "1"}


class Fixed:
    """A scorer returning whatever raw values it was given (missing endpoints: nothing)."""

    def __init__(self, name: str, values: Mapping[Endpoint, float]) -> None:
        self.name = name
        self.values = dict(values)

    def score(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> dict[Endpoint, float]:
        return {e: v for e, v in self.values.items() if e in candidates}


class KeepOrder:
    name = "keep-order"

    def pick(self, request: InferenceRequest, scored: list[ScoredEndpoint]) -> list[ScoredEndpoint]:
        return list(scored)


def scheduler(*scorers: tuple[Any, float], filters: tuple = (), picker: Any = None) -> Scheduler:
    profile = Profile(
        "p",
        tuple(filters),
        tuple(WeightedScorer(s, w) for s, w in scorers),
        picker or KeepOrder(),
    )
    return Scheduler({"p": profile}, make_plugin("single"), GatewayMetrics())


async def test_raw_scores_are_clamped_and_nan_is_zero():
    fleet = [endpoint(i) for i in range(1, 8)]
    raw = [1.7, -0.3, math.nan, math.inf, -math.inf, 0.4]  # the 7th endpoint is missing: 0
    s = scheduler((Fixed("raw", dict(zip(fleet, raw, strict=False))), 1.0))
    ranked = (await s.schedule(request(**DEBUG), fleet)).ranked
    assert [r.scores["raw"] for r in ranked] == [1.0, 0.0, 0.0, 1.0, 0.0, 0.4, 0.0]
    assert [r.score for r in ranked] == [1.0, 0.0, 0.0, 1.0, 0.0, 0.4, 0.0]


async def test_weighted_sum_of_scorers():
    a, b = endpoint(1), endpoint(2)
    s = scheduler(
        (Fixed("x", {a: 0.5, b: 1.0}), 2.0),
        (Fixed("y", {a: 1.0, b: 0.2}), 0.5),
        (Fixed("z", {a: 1.0, b: 1.0}), 0.0),
    )
    ranked = (await s.schedule(request(**DEBUG), [a, b])).ranked
    assert ranked[0].score == pytest.approx(2 * 0.5 + 0.5 * 1.0)
    assert ranked[1].score == pytest.approx(2 * 1.0 + 0.5 * 0.2)
    assert ranked[0].scores == {"x": 0.5, "y": 1.0, "z": 1.0}  # unweighted, per plugin


async def test_clamping_happens_before_weighting():
    a, b = endpoint(1), endpoint(2)
    s = scheduler((Fixed("big", {a: 50.0, b: 0.9}), 3.0))
    ranked = (await s.schedule(request(), [a, b])).ranked
    assert [r.score for r in ranked] == pytest.approx([3.0, 2.7])


async def test_max_score_picks_the_highest_weighted_total():
    a, b, c = endpoint(1), endpoint(2), endpoint(3)
    s = scheduler(
        (Fixed("x", {a: 1.0, b: 0.0, c: 0.5}), 1.0),
        (Fixed("y", {a: 0.0, b: 1.0, c: 0.5}), 3.0),
        picker=make_plugin("max-score"),
    )
    ranked = (await s.schedule(request(), [a, b, c])).ranked
    assert [r.endpoint for r in ranked] == [b, c, a]


async def test_plugin_latency_histogram_is_populated():
    """Every plugin is timed on one request in PLUGIN_TIMING_EVERY; scheduling on every request."""
    a, b = endpoint(1), endpoint(2, healthy=False)
    s = scheduler((Fixed("fx", {a: 1.0}), 1.0), filters=(make_plugin("healthy"),))
    requests = 5 * PLUGIN_TIMING_EVERY
    for _ in range(requests):
        await s.schedule(request(), [a, b])
    registry = s._metrics.registry
    sample = registry.get_sample_value
    name = "llm_gateway_plugin_duration_seconds_count"
    assert sample(name, {"kind": "filter", "plugin": "under-test"}) == 5
    assert sample(name, {"kind": "scorer", "plugin": "fx"}) == 5
    assert sample(name, {"kind": "picker", "plugin": "keep-order"}) == 5
    assert sample("llm_gateway_plugin_duration_seconds_sum", {"kind": "scorer", "plugin": "fx"}) > 0
    assert sample("llm_gateway_scheduling_duration_seconds_count") == requests


async def test_filters_removing_everything_raise_no_healthy_endpoint():
    s = scheduler(filters=(make_plugin("healthy"),))
    with pytest.raises(NoHealthyEndpoint) as info:
        await s.schedule(request("m"), [endpoint(1, healthy=False), endpoint(2, healthy=False)])
    assert info.value.status == 503
    assert "under-test" in info.value.message
    assert info.value.retry_after is not None


async def test_preparing_plugins_are_awaited_before_scoring():
    calls: list[str] = []

    class Preparing(Fixed):
        async def prepare(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> None:
            calls.append(f"prepare:{len(candidates)}")

        def score(self, request, candidates):
            calls.append("score")
            return super().score(request, candidates)

    a = endpoint(1)
    s = scheduler((Preparing("prep", {a: 1.0}), 1.0))
    await s.schedule(request(), [a])
    assert calls == ["prepare:1", "score"]


# ---- third-party plugins ----------------------------------------------------------


class PreferLabel:
    """Scores 1 for endpoints carrying ``label=value``, else 0."""

    def __init__(self, name: str, key: str, value: str) -> None:
        self.name = name
        self.key, self.value = key, value

    def score(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> dict[Endpoint, float]:
        return {e: 1.0 if e.labels.get(self.key) == self.value else 0.0 for e in candidates}


def prefer_label(name: str, parameters: Mapping[str, Any], context: Any = None) -> PreferLabel:
    params = dict(parameters)
    key, value = params.pop("key", None), params.pop("value", None)
    if not isinstance(key, str) or not isinstance(value, str):
        raise ValueError("parameters.key: 'key' and 'value' must be strings")
    if params:
        raise ValueError(f"parameters.{next(iter(params))}: unknown parameter")
    return PreferLabel(name, key, value)


def third_party_registry():
    registry = default_registry(load_entry_points=False)
    registry.register("prefer-label", PluginKind.SCORER, prefer_label)
    return registry


def test_registering_a_type_twice_is_refused():
    registry = third_party_registry()
    with pytest.raises(ValueError, match="prefer-label"):
        registry.register("prefer-label", PluginKind.SCORER, prefer_label)
    with pytest.raises(ValueError, match="max-score"):
        registry.register("max-score", PluginKind.PICKER, prefer_label)


THIRD_PARTY_CONFIG = {
    "plugins": [
        {"type": "healthy"},
        {"type": "model"},
        {"type": "prefer-label", "name": "gold", "parameters": {"key": "tier", "value": "gold"}},
        {"type": "in-flight"},
        {"type": "max-score"},
    ],
    "profiles": [
        {
            "name": "default",
            "plugins": [
                {"ref": "healthy"},
                {"ref": "model"},
                {"ref": "gold", "weight": 5},
                {"ref": "in-flight"},
                {"ref": "max-score"},
            ],
        }
    ],
}


async def test_third_party_plugin_used_from_config(start_upstream, start_gateway, http):
    plain, gold = await start_upstream(), await start_upstream()
    gw = await start_gateway(
        [plain.url, {"url": gold.url, "labels": {"tier": "gold"}}],
        plugin_registry=third_party_registry(),
        **THIRD_PARTY_CONFIG,
    )
    for _ in range(8):
        async with http.post(
            gw.url + "/v1/chat/completions", json=chat_body(), headers={"x-gateway-debug": "1"}
        ) as r:
            assert r.status == 200
            assert r.headers["x-gateway-endpoint"] == gold.name
            assert "gold=1.000" in r.headers["x-gateway-scores"]
    assert (len(plain.requests), len(gold.requests)) == (0, 8)


def test_third_party_plugin_parameters_are_validated_at_start_up():
    from gateway.config import load_config
    from gateway.http.app import build_app

    bad = {**THIRD_PARTY_CONFIG, "plugins": list(THIRD_PARTY_CONFIG["plugins"])}
    bad["plugins"][2] = {"type": "prefer-label", "name": "gold", "parameters": {"key": "tier", "value": 1}}
    config = load_config(overrides=bad, environ={})
    with pytest.raises(ConfigError, match=r"plugins\.2\.parameters\.key"):
        build_app(config, third_party_registry())
    # Without the registration, the type is unknown — and the error says so, by key.
    with pytest.raises(ConfigError, match=r"plugins\.2\.type: unknown plugin type 'prefer-label'"):
        build_app(load_config(overrides=THIRD_PARTY_CONFIG, environ={}))
