"""Scorer ``queue-depth``."""

from __future__ import annotations

import math

import pytest

from gateway.config import ConfigError
from tests.policies.helpers import endpoint, make_plugin, request, with_metrics


@pytest.fixture
def scorer():
    return make_plugin("queue-depth")


def test_min_max_normalised_over_candidates(scorer):
    a = with_metrics(endpoint(1), waiting=0, running=0)
    b = with_metrics(endpoint(2), waiting=5, running=0)
    c = with_metrics(endpoint(3), waiting=10, running=0)
    assert scorer.score(request(), [a, b, c]) == {a: 1.0, b: 0.5, c: 0.0}


def test_equal_queues_score_one(scorer):
    a = with_metrics(endpoint(1), waiting=3, running=1)
    b = with_metrics(endpoint(2), waiting=3, running=1)
    assert scorer.score(request(), [a, b]) == {a: 1.0, b: 1.0}


def test_requests_sent_since_the_scrape_count_as_queued(scorer):
    # Engine saw 1 running, 0 waiting; the gateway has 5 in flight: 4 arrived after the scrape.
    a = with_metrics(endpoint(1, in_flight=5), waiting=0, running=1)
    b = with_metrics(endpoint(2), waiting=2, running=0)
    c = with_metrics(endpoint(3), waiting=0, running=0)
    assert scorer.score(request(), [a, b, c]) == {a: 0.0, b: 0.5, c: 1.0}


def test_stale_metrics_fall_back_to_in_flight(scorer):
    stale = with_metrics(endpoint(1, in_flight=0), waiting=100, running=0, stale=True)
    fresh = with_metrics(endpoint(2), waiting=4, running=0)
    assert scorer.score(request(), [stale, fresh]) == {stale: 1.0, fresh: 0.0}


def test_never_scraped_uses_in_flight(scorer):
    a, b = endpoint(1, in_flight=2), endpoint(2, in_flight=0)
    assert scorer.score(request(), [a, b]) == {a: 0.0, b: 1.0}


def test_single_candidate(scorer):
    a = with_metrics(endpoint(1), waiting=50, running=0)
    assert scorer.score(request(), [a]) == {a: 1.0}


def test_a_nan_queue_listed_last_is_ignored(scorer):
    idle = with_metrics(endpoint(1), waiting=0, running=0)
    busy = with_metrics(endpoint(2), waiting=8, running=0)
    broken = with_metrics(endpoint(3), waiting=math.nan, running=0)
    scores = scorer.score(request(), [idle, busy, broken])
    assert (scores[idle], scores[busy]) == (1.0, 0.0)


def test_a_nan_queue_listed_first_does_not_erase_the_signal(scorer):
    broken = with_metrics(endpoint(1), waiting=math.nan, running=0)
    idle = with_metrics(endpoint(2), waiting=0, running=0)
    busy = with_metrics(endpoint(3), waiting=8, running=0)
    scores = scorer.score(request(), [broken, idle, busy])
    assert scores[idle] == 1.0
    assert scores[busy] == 0.0


def test_rejects_parameters():
    with pytest.raises(ConfigError, match=r"plugins\.0\.parameters\.weight"):
        make_plugin("queue-depth", {"weight": 2})
