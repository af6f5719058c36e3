"""Picker ``max-score``: highest total score first; ties (within ``tolerance``) broken at random.

Random tie-breaks matter: several gateway instances with the same view of the
fleet would otherwise all herd onto the same replica.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from gateway.scheduling.framework import PluginContext
from gateway.types import InferenceRequest, ScoredEndpoint
from policies.params import Params

TYPE_NAME = "max-score"


class MaxScorePicker:
    def __init__(self, name: str, rng: random.Random, tolerance: float) -> None:
        self.name = name
        self._rng = rng
        self._tolerance = tolerance

    def pick(self, request: InferenceRequest, scored: list[ScoredEndpoint]) -> list[ScoredEndpoint]:
        ranked = list(scored)
        self._rng.shuffle(ranked)
        ranked.sort(key=lambda s: s.score, reverse=True)  # stable: the shuffle decides ties
        if self._tolerance > 0 and len(ranked) > 1:
            floor = ranked[0].score - self._tolerance
            near = sum(1 for s in ranked if s.score >= floor)
            if near > 1:  # near-equal candidates: pick among them at random
                head = ranked[:near]
                self._rng.shuffle(head)
                ranked[:near] = head
        return ranked


def create(name: str, parameters: Mapping[str, Any], context: PluginContext) -> MaxScorePicker:
    params = Params(parameters)
    seed = params.integer("seed", None)
    tolerance = params.number("tolerance", 0.0, low=0)
    params.done()
    return MaxScorePicker(name, random.Random(seed), tolerance)
