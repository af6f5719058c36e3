"""Scorer ``slo-headroom`` over a latency model trained on known costs and a real prefix cache.

Trained TTFT = 5 ms + 0.02 ms per prefill token (uncached + pending): a 160-token miss
costs 3.2 ms, each 1,000 pending tokens 20 ms. Replicas predicted to meet the request's
deadline score above 0.5 (more headroom, higher), those predicted to miss below it.
"""

from __future__ import annotations

import dataclasses

import pytest

from gateway.admission.latency_model import LatencyModel
from policies.scorers import slo_headroom
from tests.policies.helpers import endpoint, make_plugin
from tests.policies.services import blocks_prompt, services


def _trained(svc) -> tuple[slo_headroom.SloHeadroomScorer, LatencyModel]:
    model = LatencyModel(svc.context.saturation)
    for tokens in range(0, 20000, 400):
        model.observe_ttft("fleet-member", (1.0, float(tokens), 0.0, 0.0, 0.0), 5 + 0.02 * tokens)
    context = dataclasses.replace(svc.context, latency=model)
    return slo_headroom.create("under-test", {}, context), model


async def _scores(scorer, req, candidates):
    await scorer.prepare(req, candidates)
    return scorer.score(req, candidates)


async def test_without_an_objective_the_fastest_predicted_replica_scores_1():
    svc = services()
    scorer, _ = _trained(svc)
    hot, cold = endpoint(1), endpoint(2)
    req = blocks_prompt(100)  # 1,600 tokens
    svc.prefix.record(req, hot)
    result = await _scores(scorer, req, [hot, cold])
    assert result[hot] == 1.0
    assert result[cold] == pytest.approx(5 / (5 + 0.02 * 1600), rel=0.25)  # ≈ 5 ms against ≈ 37 ms


@pytest.mark.parametrize(
    ("pending", "slo_ms", "winner"),
    [(20000.0, "200", "cold"), (1000.0, "60", "hot")],
    ids=["queue-costs-more-than-the-prefix-saves", "prefix-saves-more-than-the-queue-costs"],
)
async def test_a_tight_objective_weighs_the_prefix_hit_against_the_queue(pending, slo_ms, winner):
    svc = services()
    scorer, _ = _trained(svc)
    hot, cold = endpoint(1), endpoint(2)
    req = blocks_prompt(500, **{"x-slo-ttft-ms": slo_ms})  # 8,000 tokens: 165 ms cold
    svc.prefix.record(req, hot)
    hot.pending_prefill_tokens = pending  # hot: 405 ms / 25 ms predicted
    result = await _scores(scorer, req, [hot, cold])
    best = max(result, key=result.__getitem__)
    assert best is (hot if winner == "hot" else cold), result
    assert result[best] > 0.5 > min(result.values())  # one meets the objective, the other misses


async def test_more_headroom_scores_higher_and_misses_rank_by_how_far():
    svc = services()
    scorer, _ = _trained(svc)
    fast, medium, slow, slower = endpoint(1), endpoint(2), endpoint(3), endpoint(4)
    for e, pending in ((fast, 0.0), (medium, 2000.0), (slow, 20000.0), (slower, 40000.0)):
        e.pending_prefill_tokens = pending
    req = blocks_prompt(10, **{"x-slo-ttft-ms": "100"})
    result = await _scores(scorer, req, [fast, medium, slow, slower])
    assert result[fast] > result[medium] > 0.5 > result[slow] > result[slower]


async def test_a_missed_tpot_objective_halves_the_score():
    svc = services()
    scorer, model = _trained(svc)
    for batch in range(0, 40):
        model.observe_tpot("fleet-member", (1.0, float(batch), 0.0), 5 + 2.0 * batch)
    light, busy = endpoint(1), endpoint(2, in_flight=30)  # TPOT 5 ms / 65 ms predicted
    req = blocks_prompt(10, **{"x-slo-ttft-ms": "5000", "x-slo-tpot-ms": "30"})
    result = await _scores(scorer, req, [light, busy])
    assert result[light] > 0.5 > result[busy]


def test_parameters_are_strict_and_built_through_the_config():
    scorer = make_plugin("slo-headroom", {"tpot_penalty": 0.25})
    assert scorer.name == "under-test"
    with pytest.raises(Exception, match=r"parameters\.typo"):
        make_plugin("slo-headroom", {"typo": 1})
    with pytest.raises(Exception, match="tpot_penalty"):
        make_plugin("slo-headroom", {"tpot_penalty": 2})
