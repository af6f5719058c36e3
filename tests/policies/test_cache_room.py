"""Scorer ``cache-room``: 1 − occupancy of each replica's (believed) prefix cache.

Occupancy is what the real PrefixCache / MemoryPrefixIndex holds for the replica over the
capacity it believes the replica has: the configured default, the engine's real KV size
once scraped, shrunk by mispredictions.
"""

from __future__ import annotations

import pytest

from gateway.config import ConfigError
from policies.scorers import cache_room
from tests.policies.helpers import endpoint, make_plugin, request, with_metrics
from tests.policies.services import blocks_prompt, services


def scorer_for(svc):
    return cache_room.create("under-test", {}, svc.context)


def test_empty_caches_all_have_full_room():
    svc = services(capacity_blocks=40)
    a, b = endpoint(1), endpoint(2)
    assert scorer_for(svc).score(request(), [a, b]) == {a: 1.0, b: 1.0}


def test_room_is_one_minus_the_filled_fraction():
    svc = services(capacity_blocks=40)
    scorer = scorer_for(svc)
    a, b, c = endpoint(1), endpoint(2), endpoint(3)
    svc.prefix.record(blocks_prompt(10, "a"), a)
    svc.prefix.record(blocks_prompt(10, "b"), b)
    svc.prefix.record(blocks_prompt(20, "c"), b)
    assert svc.prefix.size(b) == 30
    assert scorer.score(request(), [a, b, c]) == {a: 0.75, b: 0.25, c: 1.0}


def test_full_cache_has_no_room_and_never_goes_negative():
    svc = services(capacity_blocks=10)
    scorer = scorer_for(svc)
    a = endpoint(1)
    svc.prefix.record(blocks_prompt(25, "x"), a)  # more than fits: the index evicts down to 10
    assert svc.prefix.size(a) == 10
    assert scorer.score(request(), [a]) == {a: 0.0}


def test_the_same_for_every_request():
    # A property of the replica, not of the prompt: a warm prompt does not change it.
    svc = services(capacity_blocks=20)
    scorer = scorer_for(svc)
    a, b = endpoint(1), endpoint(2)
    warm = blocks_prompt(5, "w")
    svc.prefix.record(warm, a)
    assert scorer.score(warm, [a, b]) == scorer.score(request(text="other"), [a, b]) == {a: 0.75, b: 1.0}


def test_engine_kv_size_replaces_the_default_capacity():
    svc = services(capacity_blocks=1000)
    scorer = scorer_for(svc)
    small, big = endpoint(1), endpoint(2)
    for e in (small, big):
        with_metrics(e)
        e.metrics.block_size = 16
    small.metrics.num_blocks = 10  # 160 tokens = 640 bytes = 10 index blocks
    big.metrics.num_blocks = 100  # 100 index blocks
    svc.prefix.update_engine_capacity(small)
    svc.prefix.update_engine_capacity(big)
    assert svc.prefix.capacity(small) == 10
    for e in (small, big):
        svc.prefix.record(blocks_prompt(5, "p"), e)
    assert scorer.score(request(), [small, big]) == {small: 0.5, big: 0.95}


async def test_mispredictions_shrink_the_believed_room():
    svc = services(capacity_blocks=1000)
    scorer = scorer_for(svc)
    a = endpoint(1)
    req = blocks_prompt(100, "m")
    svc.prefix.record(req, a)
    assert scorer.score(req, [a]) == {a: 0.9}
    await svc.prefix.match(req, [a])  # predicted: all 100 blocks cached on a
    svc.prefix.observe_usage(req, a, prompt_tokens=1600, cached_tokens=0)  # it had none
    assert svc.prefix.capacity(a) == 900
    assert scorer.score(req, [a]) == {a: pytest.approx(1 - 100 / 900)}


async def test_forgotten_replica_has_full_room_again():
    svc = services(capacity_blocks=10)
    scorer = scorer_for(svc)
    a = endpoint(1)
    svc.prefix.record(blocks_prompt(10), a)
    assert scorer.score(request(), [a]) == {a: 0.0}
    await svc.prefix.forget(a)
    assert scorer.score(request(), [a]) == {a: 1.0}


def test_no_candidates_scores_nothing():
    assert scorer_for(services()).score(request(), []) == {}


def test_a_cold_prompt_is_steered_to_the_emptier_replica():
    # Why it exists: among replicas that all miss, the emptier one keeps the new prefix longest.
    svc = services(capacity_blocks=100)
    scorer = scorer_for(svc)
    fleet = [endpoint(i) for i in range(1, 5)]
    for i, e in enumerate(fleet):
        if i:
            svc.prefix.record(blocks_prompt(10 * i, f"{i}"), e)
    result = scorer.score(blocks_prompt(3, "cold"), fleet)
    assert max(result, key=result.get) is fleet[0]
    values = [result[e] for e in fleet]
    assert values == sorted(values, reverse=True)
    assert values == pytest.approx([1.0, 0.9, 0.8, 0.7])


@pytest.mark.parametrize("params", [{"weight": 0.1}, {"capacity": 10}])
def test_takes_no_parameters(params):
    key = next(iter(params))
    with pytest.raises(ValueError, match=rf"parameters\.{key}: unknown parameter"):
        cache_room.create("under-test", params, services().context)
    with pytest.raises(ConfigError, match=rf"plugins\.0\.parameters\.{key}"):
        make_plugin("cache-room", params)
