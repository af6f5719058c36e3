"""The online latency model on synthetic data with known coefficients.

TTFT = 8 + 0.025·prefill_tokens + 40·queued + 1.5·in_flight + 10·kv_usage (ms) plus noise:
the fit recovers the coefficients, shrugs off outliers, stays sane with a handful of
samples (cold start), and a new replica starts from the fleet's fit, not from zero.
"""

from __future__ import annotations

import random

import pytest

from gateway.admission.latency_model import (
    _TPOT_PRIOR,
    _TPOT_SCALE,
    _TTFT_PRIOR,
    _TTFT_SCALE,
    LatencyModel,
    OnlineLinearModel,
)
from gateway.admission.saturation import SaturationDetector
from gateway.config import AdmissionConfig
from gateway.fleet.endpoint import Endpoint

TRUE = (8.0, 0.025, 40.0, 1.5, 10.0)


def _truth(x: tuple[float, ...]) -> float:
    return sum(a * b for a, b in zip(TRUE, x, strict=True))


def _features(rng: random.Random) -> tuple[float, ...]:
    return (
        1.0,
        rng.uniform(0, 8000),
        float(rng.choice([0, 0, 0, 1, 2, 5])),
        float(rng.randint(0, 8)),
        rng.uniform(0, 0.9),
    )


def _trained(samples: int, seed: int, outliers: bool = False) -> OnlineLinearModel:
    rng = random.Random(seed)
    model = OnlineLinearModel(_TTFT_SCALE, horizon=500)
    model.set_prior(_TTFT_PRIOR)
    for i in range(samples):
        x = _features(rng)
        y = _truth(x) + rng.gauss(0, 2)
        if outliers and i % 50 == 7:
            y *= 5  # a preempted request, a GC pause
        model.observe(x, y, _TTFT_PRIOR)
    return model


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_recovers_known_coefficients(seed: int) -> None:
    theta = _trained(600, seed).theta
    assert theta[1] == pytest.approx(0.025, rel=0.03)  # ms per prefill token
    assert theta[2] == pytest.approx(40.0, rel=0.03)  # ms per queued request
    assert theta[3] == pytest.approx(1.5, abs=0.5)
    assert theta[0] == pytest.approx(8.0, abs=3.0)
    assert theta[4] == pytest.approx(10.0, abs=4.0)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_outliers_do_not_tilt_the_fit(seed: int) -> None:
    model = _trained(600, seed, outliers=True)
    assert model.theta[1] == pytest.approx(0.025, rel=0.05)
    assert model.theta[2] == pytest.approx(40.0, rel=0.05)
    rng = random.Random(99)
    errors = [abs(model.predict(x) - _truth(x)) / _truth(x) for x in (_features(rng) for _ in range(200))]
    assert sum(errors) / len(errors) < 0.05


@pytest.mark.parametrize("samples", [0, 1, 2, 3, 5])
def test_cold_start_with_few_samples_stays_sane(samples: int) -> None:
    model = _trained(samples, seed=4)
    assert all(t >= 0 for t in model.theta)  # never a negative cost
    rng = random.Random(5)
    for x in (_features(rng) for _ in range(50)):
        predicted, true = model.predict(x), _truth(x)
        assert 0 < predicted < 5 * true + 50  # the prior's scale, never wild
    if samples >= 3:  # the dominant term (prefill) is roughly right already
        assert model.theta[1] == pytest.approx(0.025, rel=0.5)


def test_predictions_are_never_negative_and_coefficients_stay_non_negative() -> None:
    model = OnlineLinearModel(_TTFT_SCALE, horizon=100)
    rng = random.Random(6)
    for _ in range(200):  # latency falls with load: nonsense the fit must not learn
        x = _features(rng)
        model.observe(x, max(1.0, 500 - 0.05 * x[1] - 30 * x[2]), _TTFT_PRIOR)
    assert all(t >= 0 for t in model.theta)
    assert model.predict((1.0, 8000.0, 5.0, 8.0, 0.9)) > 0


def test_forgets_old_behaviour_within_its_horizon() -> None:
    model = OnlineLinearModel(_TTFT_SCALE, horizon=100)
    rng = random.Random(7)
    for _ in range(300):
        x = _features(rng)
        model.observe(x, _truth(x), _TTFT_PRIOR)
    for _ in range(600):  # the replica got twice as slow at prefill
        x = _features(rng)
        model.observe(x, _truth(x) + 0.025 * x[1], _TTFT_PRIOR)
    assert model.theta[1] == pytest.approx(0.05, rel=0.05)


def _endpoint(name: str, **state: float) -> Endpoint:
    endpoint = Endpoint(url=f"http://{name}")
    endpoint.name = name
    for key, value in state.items():
        setattr(endpoint, key, value)
    return endpoint


def test_a_new_replica_starts_from_the_fleet_fit() -> None:
    model = LatencyModel(SaturationDetector(AdmissionConfig()), min_samples=20)
    rng = random.Random(8)
    for _ in range(200):
        x = _features(rng)
        model.observe_ttft("a", x, _truth(x))
    fresh = _endpoint("new", pending_prefill_tokens=4000.0)
    assert not model.confident(fresh)
    # in_flight 0, no scrape: prefill 4000 + 1000 uncached → 8 + 0.025 × 5000
    assert model.predict_ttft(fresh, 1000.0) == pytest.approx(8 + 125, rel=0.1)
    assert model.confident(_endpoint("a"))
    x = (1.0, 500.0, 0.0, 0.0, 0.0)
    model.observe_ttft("new", x, _truth(x))
    assert model.coefficients("new")["ttft"]["prefill_tokens"] == pytest.approx(0.025, rel=0.1)


def test_replicas_are_bounded_and_forgotten() -> None:
    model = LatencyModel(SaturationDetector(AdmissionConfig()), max_replicas=3)
    for i in range(5):
        model.observe_ttft(f"r{i}", (1.0, 100.0, 0.0, 0.0, 0.0), 10.0)
    assert [model.samples(f"r{i}") for i in range(5)] == [0, 0, 1, 1, 1]
    model.forget("r4")
    assert model.samples("r4") == 0


def test_a_class_that_waits_longer_gets_its_own_bias() -> None:
    """With engine priority scheduling sheddable work waits behind the rest: one fit, per-class scale."""
    model = LatencyModel(SaturationDetector(AdmissionConfig()))
    rng = random.Random(9)
    for i in range(300):
        x = _features(rng)
        priority, slower = ("sheddable", 3.0) if i % 3 == 0 else ("standard", 1.0)
        model.observe_ttft("a", x, _truth(x) * slower, priority=priority, predicted_ms=_truth(x))
    assert model.class_bias("sheddable") > 1.5 * model.class_bias("standard")
    assert model.class_bias("critical") == 1.0  # never observed: no correction
    busy = _endpoint("a", pending_prefill_tokens=2000.0)
    assert model.predict_ttft(busy, 0.0, "sheddable") > model.predict_ttft(busy, 0.0, "standard")


@pytest.mark.parametrize("seed", [1, 2])
def test_the_tpot_fit_recovers_known_coefficients(seed: int) -> None:
    """TPOT = 12 + 0.8·in_flight + 6·kv_usage (ms): decode slows with the batch and the cache."""
    rng = random.Random(seed)
    model = OnlineLinearModel(_TPOT_SCALE, horizon=500)
    model.set_prior(_TPOT_PRIOR)
    for _ in range(600):
        x = (1.0, float(rng.randint(0, 32)), rng.uniform(0, 0.9))
        model.observe(x, 12.0 + 0.8 * x[1] + 6.0 * x[2] + rng.gauss(0, 0.3), _TPOT_PRIOR)
    intercept, per_sequence, per_kv = model.theta
    assert per_sequence == pytest.approx(0.8, rel=0.05)
    assert intercept == pytest.approx(12.0, abs=1.0)
    assert per_kv == pytest.approx(6.0, abs=1.5)
