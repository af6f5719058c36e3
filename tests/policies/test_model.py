"""Filter ``model``."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError
from tests.policies.helpers import endpoint, make_plugin, request


def test_keeps_endpoints_serving_the_model():
    flt = make_plugin("model")
    a, b, c = endpoint(1, models=("m",)), endpoint(2, models=("other",)), endpoint(3, models=("other", "m"))
    assert flt.filter(request("m"), [a, b, c]) == [a, c]
    assert flt.filter(request("other"), [a, b, c]) == [b, c]
    assert flt.filter(request("missing"), [a, b, c]) == []


def test_discovered_models_count_when_none_are_configured():
    flt = make_plugin("model")
    e = endpoint(1, models=())
    assert flt.filter(request("m"), [e]) == []
    e.discovered_models = frozenset({"m"})
    assert flt.filter(request("m"), [e]) == [e]


def test_configured_models_take_precedence_over_discovered():
    flt = make_plugin("model")
    e = endpoint(1, models=("configured",))
    e.discovered_models = frozenset({"discovered"})
    assert flt.filter(request("discovered"), [e]) == []
    assert flt.filter(request("configured"), [e]) == [e]


def test_rejects_parameters():
    with pytest.raises(ConfigError, match=r"plugins\.0\.parameters\.models"):
        make_plugin("model", {"models": ["m"]})
