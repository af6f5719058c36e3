"""The latency model trains on at most ``admission.slo.training_per_s`` answers a second per model.

Past the rate answers are sampled (token bucket, a second's worth of burst); SLO attainment still
counts every answer; a debug request always trains (its predicted TTFT is reported); the rate
changes on reload.
"""

from __future__ import annotations

import asyncio
import time

from gateway.admission.latency_model import LatencyModel, Training, _TrainingBudget
from gateway.admission.saturation import SaturationDetector
from gateway.config import AdmissionConfig
from gateway.http.reload import apply_config
from tests.admission.conftest import FAST, body
from tests.support.harness import gateway_metrics, metric_value

_X = (1.0, 100.0, 0.0, 0.0, 0.0)


def test_the_budget_takes_a_seconds_worth_then_refills_at_its_rate() -> None:
    budget = _TrainingBudget(10.0, now=0.0)
    assert sum(budget.take(10.0, 0.0) for _ in range(15)) == 10
    assert sum(budget.take(10.0, 0.5) for _ in range(15)) == 5
    assert sum(budget.take(10.0, 1000.0) for _ in range(15)) == 10  # idle time never banks more
    slow = _TrainingBudget(0.5, now=0.0)  # below one a second: one answer every two seconds
    taken = [slow.take(0.5, t) for t in (0.0, 0.5, 1.0, 2.0, 2.5, 4.0)]
    assert taken == [True, False, False, True, False, True]


def test_each_model_has_its_own_budget_and_forgetting_a_replica_drops_its_budget() -> None:
    model = LatencyModel(SaturationDetector(AdmissionConfig()), training_per_s=3.0)
    assert [model.training("a") for _ in range(4)] == [Training(True, True)] * 3 + [None]
    # "b" has budget left, the fleet's pooled model none: b's model trains, the fleet's does not.
    assert model.training("b") == Training(replica=True, fleet=False)
    model.observe_ttft("b", _X, 10.0, training=Training(replica=True, fleet=False))
    assert model.samples("b") == 1 and model.fleet.ttft.samples == 0
    assert model.training("a", always=True) == Training(True, True)
    model.forget("a")
    assert model.training("a") == Training(replica=True, fleet=False)  # a fresh budget


async def _stream(http, gw, **headers: str) -> int:
    async with http.post(gw.url + "/v1/chat/completions", json=body(stream=True), headers=headers) as r:
        await r.read()
        return r.status


async def test_past_the_rate_answers_are_sampled_but_every_slo_result_counts(
    start_upstream, start_gateway, http
) -> None:
    up = await start_upstream()
    gw = await start_gateway([up.url], policy="round-robin", admission={"slo": {"training_per_s": 4}}, **FAST)
    latency = gw.state.plugin_context.latency
    name = gw.state.registry.get(up.url).name
    started = time.monotonic()
    statuses = await asyncio.gather(*(_stream(http, gw, **{"x-slo-ttft-ms": "60000"}) for _ in range(40)))
    elapsed = time.monotonic() - started
    assert statuses == [200] * 40
    trained = latency.samples(name)
    assert 1 <= trained <= 4 + 4 * elapsed + 1, (trained, elapsed)
    text = await gateway_metrics(http, gw)
    assert metric_value(text, "llm_gateway_slo_requests_total", priority="standard", result="met") == 40
    observed = metric_value(text, "llm_gateway_latency_model_observed_ttft_seconds_count", endpoint=name)
    assert observed == trained  # the accuracy histograms cover the answers that trained the model

    assert await _stream(http, gw, **{"x-gateway-debug": "1"}) == 200
    assert latency.samples(name) == trained + 1  # a debug answer always trains

    config = gw.state.config
    slo = config.admission.slo.model_copy(update={"training_per_s": 10_000.0})
    await apply_config(
        gw.state, config.model_copy(update={"admission": config.admission.model_copy(update={"slo": slo})})
    )
    before = latency.samples(name)
    assert await asyncio.gather(*(_stream(http, gw) for _ in range(20))) == [200] * 20
    assert latency.samples(name) == before + 20  # the new rate applies from the next answer
