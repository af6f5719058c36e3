"""Scorer ``prefix-cost``: expected time-to-first-token in prefill-token units, score = min cost / cost.

cost(e) = floor + pending_prefill(e) + miss_weight × uncached(request, e) + decode_weight × in_flight(e),
with the defaults floor 16, miss_weight 1.5, decode_weight 48. Prompts here are whole prefix
blocks (64 bytes = 16 estimated tokens each) over a real PrefixCache / MemoryPrefixIndex.
"""

from __future__ import annotations

import pytest

from gateway.config import ConfigError
from policies.scorers import prefix_cost
from tests.policies.helpers import endpoint, make_plugin, request, with_metrics
from tests.policies.services import TOKENS_PER_BLOCK, blocks_prompt, services

FLOOR, MISS, DECODE = 16.0, 1.5, 48.0


def scorer_for(svc, **parameters):
    return prefix_cost.create("under-test", parameters, svc.context)


async def scores(scorer, req, candidates):
    await scorer.prepare(req, candidates)
    return scorer.score(req, candidates)


async def test_cold_idle_fleet_is_a_tie():
    svc = services()
    scorer = scorer_for(svc)
    a, b, c = endpoint(1), endpoint(2), endpoint(3)
    req = blocks_prompt(10)
    result = await scores(scorer, req, [a, b, c])
    assert result == {a: 1.0, b: 1.0, c: 1.0}
    assert scorer.cost(req, a) == FLOOR + MISS * 160


async def test_cached_replica_wins_by_the_prefill_it_saves():
    svc = services()
    scorer = scorer_for(svc)
    hot, cold = endpoint(1), endpoint(2)
    req = blocks_prompt(10)
    svc.prefix.record(req, hot)
    result = await scores(scorer, req, [hot, cold])
    assert scorer.cost(req, hot) == FLOOR  # nothing left to prefill
    assert scorer.cost(req, cold) == FLOOR + MISS * 160
    assert result == {hot: 1.0, cold: FLOOR / (FLOOR + MISS * 160)}


@pytest.mark.parametrize(
    ("pending", "winner"),
    [(239.0, "hot"), (241.0, "cold")],
    ids=["queue-shorter-than-the-miss", "queue-longer-than-the-miss"],
)
async def test_cache_hit_wins_only_while_the_saving_outweighs_the_queue(pending, winner):
    # The miss costs 1.5 × 160 = 240 token-equivalents: a hot replica with more queued
    # prefill than that loses to an idle cold one.
    svc = services()
    scorer = scorer_for(svc)
    hot, cold = endpoint(1), endpoint(2)
    hot.pending_prefill_tokens = pending
    req = blocks_prompt(10)
    svc.prefix.record(req, hot)
    result = await scores(scorer, req, [hot, cold])
    best = hot if winner == "hot" else cold
    assert result[best] == 1.0
    assert max(result.values()) == 1.0
    assert result[hot if best is cold else cold] < 1.0


async def test_equal_costs_tie_exactly():
    svc = services()
    scorer = scorer_for(svc)
    hot, cold = endpoint(1), endpoint(2)
    hot.pending_prefill_tokens = MISS * 160  # exactly the miss it saves
    req = blocks_prompt(10)
    svc.prefix.record(req, hot)
    assert await scores(scorer, req, [hot, cold]) == {hot: 1.0, cold: 1.0}


async def test_in_flight_requests_cost_decode_weight_each():
    svc = services()
    scorer = scorer_for(svc)
    busy, idle = endpoint(1, in_flight=5), endpoint(2)
    req = blocks_prompt(10)
    svc.prefix.record(req, busy)
    # 5 decoding sequences × 48 = 240 = the whole miss of 160 tokens × 1.5: a tie.
    assert await scores(scorer, req, [busy, idle]) == {busy: 1.0, idle: 1.0}
    assert scorer.cost(req, busy) == FLOOR + 5 * DECODE
    busy.in_flight = 6  # read live: one more and the cold replica wins
    result = scorer.score(req, [busy, idle])
    assert result[idle] == 1.0
    assert result[busy] == (FLOOR + MISS * 160) / (FLOOR + 6 * DECODE)


async def test_prefix_cached_everywhere_cancels_out_and_load_decides():
    svc = services()
    scorer = scorer_for(svc)
    a, b = endpoint(1, in_flight=1), endpoint(2)
    req = blocks_prompt(10)
    svc.prefix.record(req, a)
    svc.prefix.record(req, b)
    assert await scores(scorer, req, [a, b]) == {a: FLOOR / (FLOOR + DECODE), b: 1.0}


async def test_partial_match_charges_only_the_uncached_tail():
    svc = services()
    scorer = scorer_for(svc)
    a, b = endpoint(1), endpoint(2)
    svc.prefix.record(blocks_prompt(10), a)
    longer = blocks_prompt(20)  # same text, longer: shares 9 full blocks (block 10 held the end marker)
    await scorer.prepare(longer, [a, b])
    assert svc.prefix.uncached_tokens(longer, a) == 320 - 9 * TOKENS_PER_BLOCK
    assert svc.prefix.uncached_tokens(longer, b) == 320
    assert scorer.cost(longer, a) == FLOOR + MISS * (320 - 9 * TOKENS_PER_BLOCK)
    result = scorer.score(longer, [a, b])
    assert result[a] == 1.0
    assert result[b] == scorer.cost(longer, a) / scorer.cost(longer, b)


async def test_without_prepare_every_replica_misses_and_load_decides():
    svc = services()
    scorer = scorer_for(svc)
    a, b = endpoint(1), endpoint(2, in_flight=1)
    req = blocks_prompt(4)
    svc.prefix.record(req, b)  # not matched yet: prepare was not awaited
    result = scorer.score(req, [a, b])
    assert result[a] == 1.0
    assert result[b] < 1.0


async def test_prepare_matches_candidates_added_later():
    # P/D: the decode profile matches its pool, the prefill profile another; the second
    # candidate set must be matched too, not read as all misses from the first match.
    svc = services()
    scorer = scorer_for(svc)
    decode, prefill = endpoint(1), endpoint(2)
    req = blocks_prompt(6)
    svc.prefix.record(req, prefill)
    await scorer.prepare(req, [decode])
    await scorer.prepare(req, [decode, prefill])
    assert svc.prefix.uncached_tokens(req, prefill) == 0
    assert scorer.score(req, [decode, prefill])[prefill] == 1.0


async def test_prompt_with_no_full_block_is_charged_its_estimate():
    svc = services()
    scorer = scorer_for(svc)
    a, b = endpoint(1), endpoint(2)
    req = request(text="")  # a few bytes: no full prefix block, 1 estimated token
    assert svc.prefix.hashes(req) == []
    svc.prefix.record(req, a)
    assert svc.prefix.size(a) == 0  # nothing to record
    assert await scores(scorer, req, [a, b]) == {a: 1.0, b: 1.0}
    assert scorer.cost(req, a) == FLOOR + MISS * req.est_prompt_tokens


async def test_floor_keeps_scores_finite_when_every_cost_would_be_zero():
    svc = services()
    scorer = scorer_for(svc)
    a, b = endpoint(1), endpoint(2)
    req = blocks_prompt(3)
    svc.prefix.record(req, a)
    svc.prefix.record(req, b)
    assert await scores(scorer, req, [a, b]) == {a: 1.0, b: 1.0}
    b.pending_prefill_tokens = 1.0
    assert scorer.score(req, [a, b]) == {a: 1.0, b: FLOOR / (FLOOR + 1.0)}


async def test_scraped_metrics_are_not_read():
    # Live gateway counters only: stale or fresh engine queues do not move this score.
    svc = services()
    scorer = scorer_for(svc)
    a, b = endpoint(1), endpoint(2)
    with_metrics(a, waiting=50, running=50, kv=1.0)
    with_metrics(b, waiting=0, running=0, kv=0.0, stale=True)
    req = blocks_prompt(5)
    assert await scores(scorer, req, [a, b]) == {a: 1.0, b: 1.0}


async def test_single_candidate_scores_one():
    svc = services()
    scorer = scorer_for(svc)
    only = endpoint(1, in_flight=30)
    only.pending_prefill_tokens = 10_000
    assert await scores(scorer, blocks_prompt(8), [only]) == {only: 1.0}


async def test_scores_are_in_zero_one_and_fall_as_load_rises():
    svc = services()
    scorer = scorer_for(svc)
    fleet = [endpoint(i) for i in range(1, 6)]
    for i, e in enumerate(fleet):
        e.pending_prefill_tokens = 100.0 * i
    result = await scores(scorer, blocks_prompt(4), fleet)
    values = [result[e] for e in fleet]
    assert values[0] == 1.0
    assert all(0.0 < v <= 1.0 for v in values)
    assert values == sorted(values, reverse=True)
    assert len(set(values)) == len(values)


async def test_miss_weight_zero_ignores_the_cache():
    svc = services()
    scorer = scorer_for(svc, miss_weight=0)
    hot, cold = endpoint(1, in_flight=1), endpoint(2)
    req = blocks_prompt(10)
    svc.prefix.record(req, hot)
    assert await scores(scorer, req, [hot, cold]) == {hot: FLOOR / (FLOOR + DECODE), cold: 1.0}


async def test_decode_weight_zero_ignores_in_flight():
    svc = services()
    scorer = scorer_for(svc, decode_weight=0)
    hot, cold = endpoint(1, in_flight=100), endpoint(2)
    req = blocks_prompt(10)
    svc.prefix.record(req, hot)
    result = await scores(scorer, req, [hot, cold])
    assert result[hot] == 1.0
    assert result[cold] == FLOOR / (FLOOR + MISS * 160)


async def test_custom_weights_are_used():
    svc = services()
    scorer = scorer_for(svc, decode_weight=10, miss_weight=2, floor_tokens=4)
    e = endpoint(1, in_flight=3)
    e.pending_prefill_tokens = 7.0
    req = blocks_prompt(2)
    await scorer.prepare(req, [e])
    assert scorer.cost(req, e) == 4 + 7 + 2 * 32 + 10 * 3


@pytest.mark.parametrize(
    ("params", "key"),
    [
        ({"floor_tokens": 0}, "floor_tokens"),
        ({"floor_tokens": 0.5}, "floor_tokens"),
        ({"decode_weight": -1}, "decode_weight"),
        ({"miss_weight": -0.1}, "miss_weight"),
        ({"miss_weight": "1.5"}, "miss_weight"),
        ({"decode_weight": True}, "decode_weight"),
        ({"decode_weight": None}, "decode_weight"),
        ({"miss_weigth": 1.5}, "miss_weigth"),
    ],
)
def test_bad_parameters_raise_value_error_naming_the_key(params, key):
    with pytest.raises(ValueError, match=rf"parameters\.{key}\b"):
        scorer_for(services(), **params)


def test_bad_parameters_in_config_name_the_plugin_key():
    with pytest.raises(ConfigError, match=r"plugins\.0\.parameters\.floor_tokens"):
        make_plugin("prefix-cost", {"floor_tokens": 0})


def test_built_from_config_with_defaults():
    scorer = make_plugin("prefix-cost", {"miss_weight": 3})
    assert isinstance(scorer, prefix_cost.PrefixCostScorer)
    e = endpoint(1, in_flight=1)
    req = blocks_prompt(1)
    assert scorer.cost(req, e) == FLOOR + 3 * 16 + DECODE
