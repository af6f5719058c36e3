"""Scorer ``prefix-affinity``: matched blocks / prompt blocks per candidate, from a real
PrefixCache over a MemoryPrefixIndex (the longest recorded prefix, per replica)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.config import ConfigError
from policies.scorers import prefix_affinity
from tests.policies.helpers import endpoint, make_plugin, request
from tests.policies.services import blocks_prompt, services


def scorer_for(svc):
    return prefix_affinity.create("under-test", {}, svc.context)


async def scores(scorer, req, candidates):
    await scorer.prepare(req, candidates)
    return scorer.score(req, candidates)


async def test_full_hit_scores_one_and_a_miss_zero():
    svc = services()
    scorer = scorer_for(svc)
    hot, cold = endpoint(1), endpoint(2)
    req = blocks_prompt(8)
    svc.prefix.record(req, hot)
    assert await scores(scorer, req, [hot, cold]) == {hot: 1.0, cold: 0.0}


async def test_partial_prefix_scores_its_fraction():
    svc = services()
    scorer = scorer_for(svc)
    a, b = endpoint(1), endpoint(2)
    svc.prefix.record(blocks_prompt(10), a)  # shares 9 full blocks with the 20-block prompt
    svc.prefix.record(blocks_prompt(4), b)  # shares 3
    assert await scores(scorer, blocks_prompt(20), [a, b]) == {a: 9 / 20, b: 3 / 20}


async def test_longer_match_ranks_higher():
    svc = services()
    scorer = scorer_for(svc)
    fleet = [endpoint(i) for i in range(1, 5)]
    for i, e in enumerate(fleet):
        svc.prefix.record(blocks_prompt(2 + 3 * i), e)
    result = await scores(scorer, blocks_prompt(30), fleet)
    values = [result[e] for e in fleet]
    assert values == sorted(values)
    assert len(set(values)) == 4
    assert all(0.0 < v < 1.0 for v in values)


async def test_different_prompt_does_not_match():
    svc = services()
    scorer = scorer_for(svc)
    a = endpoint(1)
    svc.prefix.record(blocks_prompt(8, "a"), a)
    assert await scores(scorer, blocks_prompt(8, "b"), [a]) == {a: 0.0}


async def test_same_text_for_another_model_does_not_match():
    svc = services()
    scorer = scorer_for(svc)
    a = endpoint(1, models=("m", "other"))
    svc.prefix.record(blocks_prompt(8, model="m"), a)
    assert await scores(scorer, blocks_prompt(8, model="other"), [a]) == {a: 0.0}
    assert await scores(scorer, blocks_prompt(8, model="m"), [a]) == {a: 1.0}


async def test_ties_score_the_same():
    svc = services()
    scorer = scorer_for(svc)
    a, b = endpoint(1), endpoint(2)
    req = blocks_prompt(6)
    svc.prefix.record(req, a)
    svc.prefix.record(req, b)
    assert await scores(scorer, req, [a, b]) == {a: 1.0, b: 1.0}


async def test_without_prepare_nobody_scores():
    svc = services()
    scorer = scorer_for(svc)
    a = endpoint(1)
    req = blocks_prompt(6)
    svc.prefix.record(req, a)
    assert scorer.score(req, [a]) == {a: 0.0}


async def test_prompt_shorter_than_a_block_scores_zero_everywhere():
    svc = services()
    scorer = scorer_for(svc)
    a, b = endpoint(1), endpoint(2)
    req = request(text="")  # no full block: nothing to match, no division by zero
    svc.prefix.record(req, a)
    assert await scores(scorer, req, [a, b]) == {a: 0.0, b: 0.0}


async def test_expired_entries_no_longer_match():
    svc = services(ttl_s=0.05)
    scorer = scorer_for(svc)
    a = endpoint(1)
    svc.prefix.record(blocks_prompt(6), a)
    assert await scores(scorer, blocks_prompt(6), [a]) == {a: 1.0}
    await asyncio.sleep(0.1)
    assert await scores(scorer, blocks_prompt(6), [a]) == {a: 0.0}


async def test_eviction_drops_the_tail_of_a_prefix_first():
    svc = services(capacity_blocks=4)
    scorer = scorer_for(svc)
    a = endpoint(1)
    req = blocks_prompt(10)
    svc.prefix.record(req, a)  # only 4 blocks fit: the engine's LRU keeps the head
    assert await scores(scorer, blocks_prompt(10), [a]) == {a: 0.4}


async def test_forgotten_replica_matches_nothing():
    svc = services()
    scorer = scorer_for(svc)
    a, b = endpoint(1), endpoint(2)
    req = blocks_prompt(6)
    svc.prefix.record(req, a)
    svc.prefix.record(req, b)
    await svc.prefix.forget(a)
    assert await scores(scorer, blocks_prompt(6), [a, b]) == {a: 0.0, b: 1.0}


async def test_no_candidates_scores_nothing():
    svc = services()
    scorer = scorer_for(svc)
    assert await scores(scorer, blocks_prompt(3), []) == {}


@pytest.mark.parametrize("params", [{"min_ratio": 0.5}, {"threshold": 1}])
def test_takes_no_parameters(params):
    key = next(iter(params))
    with pytest.raises(ValueError, match=rf"parameters\.{key}: unknown parameter"):
        prefix_affinity.create("under-test", params, services().context)
    with pytest.raises(ConfigError, match=rf"plugins\.0\.parameters\.{key}"):
        make_plugin("prefix-affinity", params)


# normalize: min-max — llm-d's precise-prefix-cache-scorer reading of the same index.


def min_max_scorer(svc):
    return prefix_affinity.create("under-test", {"normalize": "min-max"}, svc.context)


async def test_min_max_longest_match_scores_one_shortest_hit_zero_and_between_in_proportion():
    svc = services()
    scorer = min_max_scorer(svc)
    a, b, c, cold = endpoint(1), endpoint(2), endpoint(3), endpoint(4)
    svc.prefix.record(blocks_prompt(10), a)  # 9 shared blocks with the 20-block prompt
    svc.prefix.record(blocks_prompt(6), b)  # 5
    svc.prefix.record(blocks_prompt(2), c)  # 1
    result = await scores(scorer, blocks_prompt(20), [a, b, c, cold])
    assert result == {a: 1.0, b: (5 - 1) / (9 - 1), c: 0.0, cold: 0.0}


async def test_min_max_a_partial_hit_alone_scores_one_where_ratio_scores_its_fraction():
    svc = services()
    a, cold = endpoint(1), endpoint(2)
    svc.prefix.record(blocks_prompt(10), a)
    assert await scores(min_max_scorer(svc), blocks_prompt(20), [a, cold]) == {a: 1.0, cold: 0.0}
    assert await scores(scorer_for(svc), blocks_prompt(20), [a, cold]) == {a: 9 / 20, cold: 0.0}


async def test_min_max_equal_hits_all_score_one_and_no_hit_scores_zero_everywhere():
    svc = services()
    scorer = min_max_scorer(svc)
    a, b, cold = endpoint(1), endpoint(2), endpoint(3)
    req = blocks_prompt(6)
    assert await scores(scorer, req, [a, b, cold]) == {a: 0.0, b: 0.0, cold: 0.0}
    svc.prefix.record(req, a)
    svc.prefix.record(req, b)
    assert await scores(scorer, blocks_prompt(6), [a, b, cold]) == {a: 1.0, b: 1.0, cold: 0.0}


def test_normalize_must_be_a_known_mode():
    with pytest.raises(ValueError, match=r"parameters\.normalize: 'max'"):
        prefix_affinity.create("under-test", {"normalize": "max"}, services().context)
    assert make_plugin("prefix-affinity", {"normalize": "min-max"})._min_max
