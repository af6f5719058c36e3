"""Odd admission / SLO values in the config: refused at load with a clear message, or served sanely."""

from __future__ import annotations

import math

import pytest

from gateway.admission.queue import RateLimited
from gateway.config import ConfigError, load_config


@pytest.mark.parametrize("value", [float("inf"), 1e309])
def test_an_infinite_retry_after_is_refused_at_load(value: float) -> None:
    """retry_after_s: .inf passes ``gt=0``; every 429 would then render Retry-After as round(inf)."""
    with pytest.raises(ConfigError, match="retry_after_s"):
        load_config(
            overrides={"endpoints": [{"url": "http://127.0.0.1:1"}], "admission": {"retry_after_s": value}},
            environ={},
        )


@pytest.mark.parametrize("retry_after", [math.inf, math.nan, 1e12, 0.2])
def test_a_retry_after_renders_as_whole_seconds_within_a_day(retry_after: float) -> None:
    """What the latency model hands over (``(best − objective) / 1000``) may be anything: the 429
    must still render (``round(inf)`` raised inside the error middleware: a plain-text 500)."""
    response = RateLimited("no replica is predicted to meet it", retry_after=retry_after).to_response()
    assert response.status == 429
    assert 1 <= int(response.headers["Retry-After"]) <= 86_400


@pytest.mark.parametrize("value", [True, "true"])
def test_a_boolean_slo_objective_is_refused(value) -> None:
    """`ttft_ms: yes` in YAML is a mistake, not a 1 ms objective (pydantic's lax float takes True as 1.0)."""
    with pytest.raises(ConfigError, match="ttft_ms"):
        load_config(
            overrides={
                "endpoints": [{"url": "http://127.0.0.1:1"}],
                "admission": {"slo": {"defaults": {"standard": {"ttft_ms": value}}}},
            },
            environ={},
        )
