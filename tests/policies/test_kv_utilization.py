"""Scorer ``kv-utilization``."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError
from tests.policies.helpers import endpoint, make_plugin, request, with_metrics


@pytest.fixture
def scorer():
    return make_plugin("kv-utilization")


def test_free_fraction_when_fresh(scorer):
    a = with_metrics(endpoint(1), kv=0.25)
    b = with_metrics(endpoint(2), kv=1.0)
    c = with_metrics(endpoint(3), kv=0.0)
    assert scorer.score(request(), [a, b, c]) == {a: 0.75, b: 0.0, c: 1.0}


def test_stale_or_unknown_usage_is_neutral(scorer):
    stale = with_metrics(endpoint(1), kv=0.0, stale=True)
    unknown = with_metrics(endpoint(2), kv=None)
    never = endpoint(3)
    assert scorer.score(request(), [stale, unknown, never]) == {stale: 0.5, unknown: 0.5, never: 0.5}


def test_scores_every_candidate(scorer):
    fleet = [with_metrics(endpoint(i), kv=i / 10) for i in range(1, 6)]
    assert set(scorer.score(request(), fleet)) == set(fleet)


def test_rejects_parameters():
    with pytest.raises(ConfigError, match=r"plugins\.0\.parameters\.neutral"):
        make_plugin("kv-utilization", {"neutral": 0.5})
