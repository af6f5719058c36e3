"""Picker ``random``."""

from __future__ import annotations

from collections import Counter

import pytest

from gateway.config import ConfigError
from tests.policies.helpers import endpoint, make_plugin, request, scored


def test_returns_a_permutation_ignoring_scores():
    picker = make_plugin("random")
    a, b, c = endpoint(1), endpoint(2), endpoint(3)
    orders = Counter()
    for _ in range(600):
        ranked = picker.pick(request(), scored((a, 0.0), (b, 0.5), (c, 3.0)))
        assert sorted(s.endpoint.url for s in ranked) == [a.url, b.url, c.url]
        orders[tuple(s.endpoint.url for s in ranked)] += 1
    # All 3! orders appear, the lowest score first included (expected ~100 each).
    assert len(orders) == 6
    assert min(orders.values()) > 30


def test_seeded_is_reproducible():
    fleet = [endpoint(i) for i in range(1, 6)]

    def run(seed: int) -> list[list[str]]:
        picker = make_plugin("random", {"seed": seed})
        return [
            [s.endpoint.url for s in picker.pick(request(), scored(*((e, 0.0) for e in fleet)))]
            for _ in range(10)
        ]

    assert run(3) == run(3)
    assert run(3) != run(4)


@pytest.mark.parametrize("params", [{"seed": "1"}, {"shuffle": True}])
def test_bad_parameters_name_the_key(params):
    key = next(iter(params))
    with pytest.raises(ConfigError, match=rf"plugins\.0\.parameters\.{key}"):
        make_plugin("random", params)
