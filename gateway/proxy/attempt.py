"""The settings and the state one upstream attempt carries, and the failure that re-sends it."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from gateway.config import LimitConfig, TimeoutConfig
from gateway.proxy.hooks import RequestHooks
from gateway.proxy.resilience import RetryBudget

__all__ = ["Attempt", "ProxySettings", "Retryable"]


@dataclass(frozen=True, slots=True)
class ProxySettings:
    """What a config reload may change; requests already running keep the values they started with."""

    timeouts: TimeoutConfig
    limits: LimitConfig
    retry_budget: RetryBudget
    retry_backoff_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Attempt:
    started: float  # time.monotonic() at arrival, for latency metrics
    deadline: float  # loop time by which the whole request must end
    settings: ProxySettings
    hooks: RequestHooks


class Retryable(Exception):
    """Nothing reached the client yet: the request may be re-sent to the next endpoint.

    ``response`` is the upstream's own error answer, passed on if no re-send succeeds."""

    def __init__(self, reason: str, response: web.Response | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.response = response
