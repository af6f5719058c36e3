"""Picker ``round-robin``: cycles through the candidates in a stable (URL) order.

One cycle per model and candidate set (a model's replicas, a profile's pool): one counter shared
by all sent every other request of two interleaved models to the same replica of each (review
findings: an embed-then-chat pipeline put 20 of 20 chat requests on one of its two replicas, on
separate pools and on one shared pool alike)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.request.types import InferenceRequest
from gateway.scheduling.framework import PluginContext
from gateway.scheduling.result import ScoredEndpoint
from policies.params import Params

TYPE_NAME = "round-robin"


_MAX_SETS = 4096  # candidate sets remembered; past it, every cycle starts again


class RoundRobinPicker:
    def __init__(self, name: str) -> None:
        self.name = name
        self._next: dict[tuple[str, ...], int] = {}  # (model, *candidate URLs) -> its next turn

    def pick(self, request: InferenceRequest, scored: list[ScoredEndpoint]) -> list[ScoredEndpoint]:
        ordered = sorted(scored, key=lambda s: s.endpoint.url)
        key = (request.model, *(s.endpoint.url for s in ordered))  # two models on one pool: two cycles
        turn = self._next.get(key, 0)
        if turn == 0 and len(self._next) >= _MAX_SETS:
            self._next.clear()
        self._next[key] = turn + 1
        start = turn % len(ordered)
        return ordered[start:] + ordered[:start]


def create(name: str, parameters: Mapping[str, Any], context: PluginContext) -> RoundRobinPicker:
    Params(parameters).done()
    return RoundRobinPicker(name)
