"""Picker ``max-score``."""

from __future__ import annotations

from collections import Counter

import pytest

from gateway.config import ConfigError
from tests.policies.helpers import endpoint, make_plugin, request, scored


def test_orders_by_score_descending():
    picker = make_plugin("max-score")
    a, b, c = endpoint(1), endpoint(2), endpoint(3)
    ranked = picker.pick(request(), scored((a, 0.2), (b, 2.5), (c, 1.0)))
    assert [s.endpoint for s in ranked] == [b, c, a]


def test_does_not_mutate_its_input():
    picker = make_plugin("max-score")
    items = scored((endpoint(1), 0.1), (endpoint(2), 0.9))
    before = list(items)
    picker.pick(request(), items)
    assert items == before


def test_ties_are_broken_at_random():
    picker = make_plugin("max-score")
    a, b, low = endpoint(1), endpoint(2), endpoint(3)
    firsts = Counter()
    for _ in range(400):
        ranked = picker.pick(request(), scored((a, 1.0), (b, 1.0), (low, 0.5)))
        firsts[ranked[0].endpoint] += 1
        assert ranked[-1].endpoint is low
    # Both tied endpoints lead; a fair coin gives ~200 each (P(< 100) is astronomically small).
    assert firsts[a] > 100
    assert firsts[b] > 100
    assert firsts[low] == 0


def test_seed_makes_tie_breaks_reproducible():
    fleet = [endpoint(i) for i in range(1, 6)]

    def run(seed: int) -> list[list[str]]:
        picker = make_plugin("max-score", {"seed": seed})
        return [
            [s.endpoint.url for s in picker.pick(request(), scored(*((e, 1.0) for e in fleet)))]
            for _ in range(10)
        ]

    assert run(7) == run(7)
    assert run(7) != run(8)


@pytest.mark.parametrize("params", [{"seed": "x"}, {"seed": 1.5}, {"seed": True}, {"sed": 1}])
def test_bad_parameters_name_the_key(params):
    key = next(iter(params))
    with pytest.raises(ConfigError, match=rf"plugins\.0\.parameters\.{key}"):
        make_plugin("max-score", params)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_parameters_are_refused(value):
    """A NaN tolerance passed the range check and tied nothing: every request to one replica."""
    with pytest.raises(ConfigError, match="finite"):
        make_plugin("max-score", {"tolerance": value})
