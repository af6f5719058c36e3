"""Picker ``round-robin``: cycles through the candidates in a stable (URL) order."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from gateway.request.types import InferenceRequest
from gateway.scheduling.framework import PluginContext
from gateway.scheduling.result import ScoredEndpoint
from policies.params import Params

TYPE_NAME = "round-robin"


class RoundRobinPicker:
    def __init__(self, name: str) -> None:
        self.name = name
        self._counter = itertools.count()

    def pick(self, request: InferenceRequest, scored: list[ScoredEndpoint]) -> list[ScoredEndpoint]:
        ordered = sorted(scored, key=lambda s: s.endpoint.url)
        start = next(self._counter) % len(ordered)
        return ordered[start:] + ordered[:start]


def create(name: str, parameters: Mapping[str, Any], context: PluginContext) -> RoundRobinPicker:
    Params(parameters).done()
    return RoundRobinPicker(name)
