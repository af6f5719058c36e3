"""Picker ``random``: uniform random order, ignoring scores (a baseline)."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from gateway.request.types import InferenceRequest
from gateway.scheduling.framework import PluginContext
from gateway.scheduling.result import ScoredEndpoint
from policies.params import Params

TYPE_NAME = "random"


class RandomPicker:
    def __init__(self, name: str, rng: random.Random) -> None:
        self.name = name
        self._rng = rng

    def pick(self, request: InferenceRequest, scored: list[ScoredEndpoint]) -> list[ScoredEndpoint]:
        ranked = list(scored)
        self._rng.shuffle(ranked)
        return ranked


def create(name: str, parameters: Mapping[str, Any], context: PluginContext) -> RandomPicker:
    params = Params(parameters)
    seed = params.integer("seed", None)
    params.done()
    return RandomPicker(name, random.Random(seed))
