"""The settings and the state one upstream attempt carries, and the failure that re-sends it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from gateway.config import LimitConfig, TimeoutConfig
from gateway.errors import UpstreamError
from gateway.fleet.endpoint import Endpoint
from gateway.proxy.hooks import RequestHooks
from gateway.proxy.resilience import RetryBudget
from gateway.request.types import ApiKind, InferenceRequest

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


def lost_before_answer(request: InferenceRequest, endpoint: Endpoint) -> Exception:
    """The replica took the request, then its connection or stream broke before anything reached
    the client: re-sent elsewhere, unless the replica keeps running it. A Responses request with
    ``background: true`` is stored and run by the engine from the start (vLLM), whatever becomes
    of the connection: re-sent, it would run twice and leave two stored responses, one whose id
    nobody was told."""
    if request.api is ApiKind.RESPONSES and request.body.get("background") is True:
        return UpstreamError(
            f"the connection to {endpoint.name} broke after it took a background response, which it"
            " keeps running: not sent again elsewhere"
        )
    return Retryable("disconnected")


def sending(request: InferenceRequest, then: Callable[[], None]) -> Callable[[], None]:
    """The upstream client's ``on_slot``: a connection to the replica is held and the request goes
    out (a client that leaves from now on has cost the replica its prompt:
    ``TenantAuth.settle_later``); then ``then``."""

    def on_slot() -> None:
        request.context.sent = True
        then()

    return on_slot
