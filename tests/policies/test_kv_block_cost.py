"""Scorer ``kv-block-cost``: Dynamo's KV-router logit in blocks, score = min logit / logit.

logit(e) = overlap_score_weight × (pending_prefill(e) + uncached(request, e)) / block
           + in_flight_tokens(e) / block + the request's own blocks,
over a real PrefixCache / MemoryPrefixIndex; prompts are whole prefix blocks (64 bytes = 16
estimated tokens each), and the fallback block size is 16 tokens, so a 10-block prompt is
160 tokens = 10 engine blocks.
"""

from __future__ import annotations

import pytest

from gateway.config import ConfigError
from policies.scorers import kv_block_cost
from tests.policies.helpers import endpoint, make_plugin, with_metrics
from tests.policies.services import blocks_prompt, services


def scorer_for(svc, **parameters):
    return kv_block_cost.create("under-test", parameters, svc.context)


async def scores(scorer, req, candidates):
    await scorer.prepare(req, candidates)
    return scorer.score(req, candidates)


async def test_cold_idle_fleet_is_a_tie_of_prefill_plus_own_blocks():
    svc = services()
    scorer = scorer_for(svc)
    a, b = endpoint(1), endpoint(2)
    req = blocks_prompt(10)
    assert await scores(scorer, req, [a, b]) == {a: 1.0, b: 1.0}
    assert scorer.logit(req, a) == 10 + 10


async def test_cached_replica_saves_its_prefill_blocks():
    svc = services()
    scorer = scorer_for(svc)
    hot, cold = endpoint(1), endpoint(2)
    req = blocks_prompt(10)
    svc.prefix.record(req, hot)
    assert await scores(scorer, req, [hot, cold]) == {hot: 1.0, cold: 10 / 20}


@pytest.mark.parametrize(("in_flight_tokens", "winner"), [(159, "hot"), (161, "cold")])
async def test_a_hit_loses_once_the_blocks_in_flight_there_exceed_the_miss(in_flight_tokens, winner):
    # The miss costs 10 blocks; 160 prompt tokens in flight on the hot replica are 10 blocks of
    # decode load. (prefix-cost charges one such request 48 token-equivalents, not 160 × 1.)
    svc = services()
    scorer = scorer_for(svc)
    hot, cold = endpoint(1, in_flight=1, in_flight_tokens=in_flight_tokens), endpoint(2)
    req = blocks_prompt(10)
    svc.prefix.record(req, hot)
    result = await scores(scorer, req, [hot, cold])
    best, other = (hot, cold) if winner == "hot" else (cold, hot)
    assert result[best] == 1.0
    assert result[other] < 1.0


async def test_pending_prefill_is_weighted_like_this_requests_prefill():
    svc = services()
    scorer = scorer_for(svc, overlap_score_weight=2)
    hot, cold = endpoint(1), endpoint(2)
    hot.pending_prefill_tokens = 80.0  # 5 blocks, × 2
    req = blocks_prompt(10)
    svc.prefix.record(req, hot)
    await scorer.prepare(req, [hot, cold])
    assert scorer.logit(req, hot) == 2 * 5 + 10
    assert scorer.logit(req, cold) == 2 * 10 + 10
    assert scorer.score(req, [hot, cold]) == {hot: 1.0, cold: 20 / 30}


async def test_weight_zero_ignores_the_cache_and_load_decides():
    svc = services()
    scorer = scorer_for(svc, overlap_score_weight=0)
    hot, cold = endpoint(1, in_flight=1, in_flight_tokens=16), endpoint(2)
    req = blocks_prompt(10)
    svc.prefix.record(req, hot)
    assert await scores(scorer, req, [hot, cold]) == {hot: 10 / 11, cold: 1.0}


async def test_the_engines_block_size_is_used_once_scraped():
    svc = services()
    scorer = scorer_for(svc)
    e = endpoint(1)
    req = blocks_prompt(10)
    await scorer.prepare(req, [e])
    assert scorer.logit(req, e) == 20
    e.metrics.block_size = 32
    assert scorer.logit(req, e) == 160 / 32 + 5


async def test_counters_are_read_live():
    svc = services()
    scorer = scorer_for(svc)
    a, b = endpoint(1), endpoint(2)
    req = blocks_prompt(4)
    assert await scores(scorer, req, [a, b]) == {a: 1.0, b: 1.0}
    b.in_flight_tokens = 64
    assert scorer.score(req, [a, b]) == {a: 1.0, b: 8 / 12}


@pytest.mark.parametrize(
    ("params", "key"),
    [
        ({"overlap_score_weight": -1}, "overlap_score_weight"),
        ({"block_tokens": 0}, "block_tokens"),
        ({"block_tokens": 1.5}, "block_tokens"),
        ({"router_temperature": 0.5}, "router_temperature"),
        ({"active_blocks": "scraped"}, "active_blocks"),
    ],
)
def test_bad_parameters_name_the_key(params, key):
    with pytest.raises(ValueError, match=rf"parameters\.{key}\b"):
        scorer_for(services(), **params)
    with pytest.raises(ConfigError, match=rf"plugins\.0\.parameters\.{key}"):
        make_plugin("kv-block-cost", params)


def test_built_from_config():
    scorer = make_plugin("kv-block-cost", {"overlap_score_weight": 3, "block_tokens": 32})
    assert isinstance(scorer, kv_block_cost.KvBlockCostScorer)
    e = endpoint(1)
    assert scorer.logit(blocks_prompt(2), e) == 3 * 32 / 32 + 1


async def test_engine_active_blocks_read_the_scraped_usage_plus_what_was_sent_since():
    svc = services()
    scorer = scorer_for(svc, active_blocks="engine")
    a, b = endpoint(1, in_flight=2, in_flight_tokens=320), endpoint(2, in_flight=2, in_flight_tokens=320)
    req = blocks_prompt(10)
    await scorer.prepare(req, [a, b])
    # a: its two requests share a prefix, the engine holds 12 blocks for them (not 20)
    with_metrics(a, kv=0.25)
    a.metrics.num_blocks, a.metrics.in_flight_tokens_at_scrape = 48, 320
    assert scorer.active_blocks(a) == 12
    # b: scraped before the second request (160 tokens) was sent
    with_metrics(b, kv=0.25)
    b.metrics.num_blocks, b.metrics.in_flight_tokens_at_scrape = 48, 160
    assert scorer.active_blocks(b) == 12 + 10
    assert scorer.score(req, [a, b]) == {a: 1.0, b: (10 + 12 + 10) / (10 + 22 + 10)}


async def test_engine_active_blocks_fall_back_to_the_gateways_count_without_a_fresh_scrape():
    svc = services()
    scorer = scorer_for(svc, active_blocks="engine")
    e = endpoint(1, in_flight=1, in_flight_tokens=64)
    assert scorer.active_blocks(e) == 4  # never scraped
    with_metrics(e, kv=0.5, stale=True)
    e.metrics.num_blocks = 100
    assert scorer.active_blocks(e) == 4
