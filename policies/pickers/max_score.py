"""Picker ``max-score``: highest total score first; ties (within ``tolerance``) broken at random.

Random tie-breaks matter: several gateway instances with the same view of the
fleet would otherwise all herd onto the same replica.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from gateway.request.types import InferenceRequest
from gateway.scheduling.framework import PluginContext
from gateway.scheduling.result import ScoredEndpoint
from policies.params import Params

TYPE_NAME = "max-score"


class MaxScorePicker:
    def __init__(self, name: str, rng: random.Random, tolerance: float) -> None:
        self.name = name
        self._rng = rng
        self._tolerance = tolerance

    def pick(self, request: InferenceRequest, scored: list[ScoredEndpoint]) -> list[ScoredEndpoint]:
        ranked = sorted(scored, key=_score, reverse=True)
        if len(ranked) > 1:
            # The best candidate and every one within the tolerance of it (or tied with it)
            # are equally good: put one of them first at random. Lower ranks only matter as
            # retry fallbacks and keep their score order.
            floor = ranked[0].score - self._tolerance
            near = 1
            while near < len(ranked) and ranked[near].score >= floor:
                near += 1
            if near > 1:
                head = ranked[:near]
                self._rng.shuffle(head)
                ranked[:near] = head
        return ranked


def _score(scored: ScoredEndpoint) -> float:
    return scored.score


def create(name: str, parameters: Mapping[str, Any], context: PluginContext) -> MaxScorePicker:
    params = Params(parameters)
    seed = params.integer("seed", None)
    tolerance = params.number("tolerance", 0.0, low=0)
    params.done()
    return MaxScorePicker(name, random.Random(seed), tolerance)
