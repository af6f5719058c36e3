"""Filter ``healthy``."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError
from tests.policies.helpers import endpoint, make_plugin, request


def test_keeps_only_healthy_endpoints_in_order():
    flt = make_plugin("healthy")
    a, b, c, d = endpoint(1), endpoint(2, healthy=False), endpoint(3), endpoint(4, healthy=False)
    assert flt.filter(request(), [a, b, c, d]) == [a, c]
    assert flt.name == "under-test"


def test_all_unhealthy_leaves_nothing():
    flt = make_plugin("healthy")
    assert flt.filter(request(), [endpoint(1, healthy=False), endpoint(2, healthy=False)]) == []


def test_health_is_read_live():
    flt = make_plugin("healthy")
    e = endpoint(1)
    assert flt.filter(request(), [e]) == [e]
    e.healthy = False
    assert flt.filter(request(), [e]) == []


def test_rejects_parameters():
    with pytest.raises(ConfigError, match=r"plugins\.0\.parameters\.strict"):
        make_plugin("healthy", {"strict": True})
