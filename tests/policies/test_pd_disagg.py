"""Profile handler ``pd-disagg``: decode profile first, then (maybe) the prefill profile.

The ``prefix-aware`` decider disaggregates when the part of the prompt the *top-ranked*
decode replica has not cached exceeds ``threshold_tokens``. Prompts are whole prefix blocks
(16 estimated tokens each) over a real PrefixCache / MemoryPrefixIndex; the scheduler tests
run real role filters, the prefix-cost scorer and the max-score picker.
"""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, load_config
from gateway.fleet.endpoint import Role
from gateway.http.app import build_app
from gateway.scheduling.result import PDDecision
from gateway.scheduling.scheduler import Profile, Scheduler, WeightedScorer
from policies.filters import role as role_filter
from policies.pickers import max_score
from policies.profiles import pd_disagg
from policies.scorers import prefix_cost
from tests.policies.helpers import endpoint, request, scored
from tests.policies.services import blocks_prompt, services

PROFILES = ["decode", "prefill"]


def handler_for(svc, **parameters):
    return pd_disagg.create("under-test", parameters, svc.context)


def decode_results(*endpoints):
    return {"decode": scored(*((e, 1.0 - i * 0.1) for i, e in enumerate(endpoints)))}


def test_runs_decode_first_then_stops_once_prefill_ran():
    svc = services()
    handler = handler_for(svc, decider="always")
    req = blocks_prompt(2)
    assert handler.pick_profiles(req, PROFILES, {}) == ["decode"]
    results = decode_results(endpoint(1))
    assert handler.pick_profiles(req, PROFILES, results) == ["prefill"]
    results["prefill"] = scored((endpoint(2, role=Role.PREFILL), 1.0))
    assert handler.pick_profiles(req, PROFILES, results) == []


def test_always_disaggregates():
    svc = services()
    handler = handler_for(svc, decider="always")
    req = request(text="")  # even the shortest prompt
    assert handler.pick_profiles(req, PROFILES, decode_results(endpoint(1))) == ["prefill"]
    assert req.context.pd_decision == PDDecision(True, "always")


def test_never_disaggregates():
    svc = services()
    handler = handler_for(svc, decider="never")
    req = blocks_prompt(200)
    assert handler.pick_profiles(req, PROFILES, decode_results(endpoint(1))) == []
    assert req.context.pd_decision == PDDecision(False, "never")


def test_prefix_aware_is_the_default_with_threshold_512():
    svc = services()
    handler = handler_for(svc)
    long_cold, short_cold = blocks_prompt(33), blocks_prompt(32)  # 528 and 512 uncached tokens
    assert handler.pick_profiles(long_cold, PROFILES, decode_results(endpoint(1))) == ["prefill"]
    assert long_cold.context.pd_decision == PDDecision(True, "uncached_prompt_long")
    assert handler.pick_profiles(short_cold, PROFILES, decode_results(endpoint(1))) == []
    assert short_cold.context.pd_decision == PDDecision(False, "uncached_prompt_short")


@pytest.mark.parametrize(("blocks", "disaggregate"), [(9, False), (10, False), (11, True)])
def test_threshold_is_strict(blocks, disaggregate):
    svc = services()
    handler = handler_for(svc, threshold_tokens=160)  # exactly 10 blocks
    req = blocks_prompt(blocks)
    picked = handler.pick_profiles(req, PROFILES, decode_results(endpoint(1)))
    assert picked == (["prefill"] if disaggregate else [])
    assert req.context.pd_decision.disaggregate is disaggregate


async def test_a_prompt_cached_on_the_top_decode_replica_stays_in_place():
    svc = services()
    handler = handler_for(svc, threshold_tokens=100)
    top, second = endpoint(1), endpoint(2)
    req = blocks_prompt(40)
    svc.prefix.record(req, top)
    await svc.prefix.match(req, [top, second])
    assert handler.pick_profiles(req, PROFILES, decode_results(top, second)) == []
    assert req.context.pd_decision == PDDecision(False, "uncached_prompt_short")


async def test_only_the_top_decode_replica_counts():
    svc = services()
    handler = handler_for(svc, threshold_tokens=100)
    top, second = endpoint(1), endpoint(2)
    req = blocks_prompt(40)
    svc.prefix.record(req, second)  # warm, but not where the request goes
    await svc.prefix.match(req, [top, second])
    assert handler.pick_profiles(req, PROFILES, decode_results(top, second)) == ["prefill"]


async def test_partly_cached_prompt_counts_only_the_uncached_tail():
    svc = services()
    handler = handler_for(svc, threshold_tokens=100)
    top = endpoint(1)
    svc.prefix.record(blocks_prompt(30), top)  # 29 blocks shared with the 36-block prompt
    req = blocks_prompt(36)
    await svc.prefix.match(req, [top])
    assert svc.prefix.uncached_tokens(req, top) == 7 * 16  # 112 > 100
    assert handler.pick_profiles(req, PROFILES, decode_results(top)) == ["prefill"]


def test_threshold_zero_disaggregates_any_uncached_prompt():
    svc = services()
    handler = handler_for(svc, threshold_tokens=0)
    req = request(text="")  # 1 estimated token, nothing cached
    assert handler.pick_profiles(req, PROFILES, decode_results(endpoint(1))) == ["prefill"]


def test_primary_is_decode_and_prefill_only_when_it_ran():
    svc = services()
    handler = handler_for(svc, decode_profile="d", prefill_profile="p")
    assert handler.profiles_used() == ("d", "p")
    req = blocks_prompt(2)
    results = {"d": scored((endpoint(1), 1.0))}
    assert handler.primary_profile(req, results) == "d"
    assert handler.prefill_profile(req, results) is None
    results["p"] = scored((endpoint(2, role=Role.PREFILL), 1.0))
    assert handler.primary_profile(req, results) == "d"
    assert handler.prefill_profile(req, results) == "p"


def test_custom_profile_names_are_run():
    svc = services()
    handler = handler_for(svc, decider="always", decode_profile="d", prefill_profile="p")
    req = blocks_prompt(2)
    assert handler.pick_profiles(req, ["d", "p"], {}) == ["d"]
    assert handler.pick_profiles(req, ["d", "p"], {"d": scored((endpoint(1), 1.0))}) == ["p"]


# -- through a real Scheduler -----------------------------------------------------------


def _scheduler(svc, **parameters) -> Scheduler:
    ctx = svc.context
    cost = prefix_cost.create("prefix-cost", {}, ctx)
    picker = max_score.create("max-score", {}, ctx)
    decode = Profile(
        "decode",
        (role_filter.create("decode-pool", {"roles": ["decode", "both"]}, ctx),),
        (WeightedScorer(cost, 1.0),),
        picker,
    )
    prefill = Profile(
        "prefill",
        (role_filter.create("prefill-pool", {"roles": ["prefill"]}, ctx),),
        (WeightedScorer(cost, 1.0),),
        picker,
    )
    return Scheduler({"decode": decode, "prefill": prefill}, handler_for(svc, **parameters), svc.metrics)


def _fleet():
    return [endpoint(1, role=Role.DECODE), endpoint(2, role=Role.DECODE), endpoint(3, role=Role.PREFILL)]


async def test_scheduler_long_cold_prompt_gets_a_prefill_leg():
    svc = services()
    fleet = _fleet()
    result = await _scheduler(svc, threshold_tokens=100).schedule(blocks_prompt(20), fleet)
    assert list(result.profile_results) == ["decode", "prefill"]
    assert result.primary_profile == "decode"
    assert result.prefill_profile == "prefill"
    assert {s.endpoint for s in result.ranked} == set(fleet[:2])
    assert [s.endpoint for s in result.prefill_ranked] == [fleet[2]]


async def test_scheduler_prompt_warm_on_a_decode_replica_is_not_disaggregated():
    svc = services()
    fleet = _fleet()
    req = blocks_prompt(20)
    svc.prefix.record(req, fleet[1])
    result = await _scheduler(svc, threshold_tokens=100).schedule(req, fleet)
    assert result.ranked[0].endpoint is fleet[1]  # prefix-cost sends it to the warm replica
    assert list(result.profile_results) == ["decode"]
    assert result.prefill_profile is None
    assert req.context.pd_decision == PDDecision(False, "uncached_prompt_short")


async def test_scheduler_short_prompt_is_not_disaggregated():
    svc = services()
    req = blocks_prompt(2)
    result = await _scheduler(svc, threshold_tokens=100).schedule(req, _fleet())
    assert result.prefill_ranked is None
    assert req.context.pd_decision == PDDecision(False, "uncached_prompt_short")


# -- parameters -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "key"),
    [
        ({"decider": "sometimes"}, "decider"),
        ({"decider": None}, "decider"),
        ({"threshold_tokens": -1}, "threshold_tokens"),
        ({"threshold_tokens": "512"}, "threshold_tokens"),
        ({"threshold_tokens": False}, "threshold_tokens"),
        ({"decode_profile": 1}, "decode_profile"),
        ({"prefill_profile": ["prefill"]}, "prefill_profile"),
        ({"threshold": 512}, "threshold"),
    ],
)
def test_bad_parameters_raise_value_error_naming_the_key(params, key):
    with pytest.raises(ValueError, match=rf"parameters\.{key}\b"):
        handler_for(services(), **params)


def _config(handler_parameters, profiles=("decode", "prefill")):
    plugins = [
        {"type": "max-score"},
        {"type": "pd-disagg", "parameters": handler_parameters},
    ]
    return load_config(
        overrides={
            "plugins": plugins,
            "profiles": [{"name": n, "plugins": [{"ref": "max-score"}]} for n in profiles],
        },
        environ={},
    )


def test_bad_parameter_in_config_names_the_plugin_key():
    with pytest.raises(ConfigError, match=r"plugins\.1\.parameters\.decider"):
        build_app(_config({"decider": "maybe"}))


def test_missing_prefill_profile_is_a_config_error():
    with pytest.raises(ConfigError, match=r"unknown profile 'prefill'"):
        build_app(_config({}, profiles=("decode",)))
