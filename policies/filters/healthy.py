"""Filter ``healthy``: only endpoints passing their health checks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gateway.fleet.endpoint import Endpoint
from gateway.request.types import InferenceRequest
from gateway.scheduling.framework import PluginContext
from policies.params import Params

TYPE_NAME = "healthy"


class HealthyFilter:
    def __init__(self, name: str) -> None:
        self.name = name

    def filter(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> list[Endpoint]:
        return [e for e in candidates if e.healthy]


def create(name: str, parameters: Mapping[str, Any], context: PluginContext) -> HealthyFilter:
    Params(parameters).done()
    return HealthyFilter(name)
