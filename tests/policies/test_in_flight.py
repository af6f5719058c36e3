"""Scorer ``in-flight``."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError
from tests.policies.helpers import endpoint, make_plugin, request


def test_by_requests_is_the_default():
    scorer = make_plugin("in-flight")
    a, b, c = endpoint(1, in_flight=0), endpoint(2, in_flight=2), endpoint(3, in_flight=4)
    assert scorer.score(request(), [a, b, c]) == {a: 1.0, b: 0.5, c: 0.0}


def test_by_tokens():
    scorer = make_plugin("in-flight", {"by": "tokens"})
    # Many short requests vs one huge prompt: tokens, not request counts, decide.
    a = endpoint(1, in_flight=10, in_flight_tokens=100)
    b = endpoint(2, in_flight=1, in_flight_tokens=400)
    assert scorer.score(request(), [a, b]) == {a: 0.75, b: 0.0}
    assert make_plugin("in-flight").score(request(), [a, b]) == {a: 0.0, b: 0.9}


def test_idle_fleet_scores_one():
    scorer = make_plugin("in-flight")
    a, b = endpoint(1), endpoint(2)
    assert scorer.score(request(), [a, b]) == {a: 1.0, b: 1.0}


def test_counts_are_read_live():
    scorer = make_plugin("in-flight")
    a, b = endpoint(1), endpoint(2)
    a.in_flight = 3
    assert scorer.score(request(), [a, b]) == {a: 0.0, b: 1.0}


@pytest.mark.parametrize("params", [{"by": "bytes"}, {"by": 1}, {"mode": "tokens"}])
def test_bad_parameters_name_the_key(params):
    key = next(iter(params))
    with pytest.raises(ConfigError, match=rf"plugins\.0\.parameters\.{key}"):
        make_plugin("in-flight", params)
