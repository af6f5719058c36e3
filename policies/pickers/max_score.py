"""Picker ``max-score``: highest total score first; ties broken at random.

Random tie-breaks matter: several gateway instances with the same view of the
fleet would otherwise all herd onto the same replica.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from gateway.types import InferenceRequest, ScoredEndpoint
from policies.params import Params

TYPE_NAME = "max-score"


class MaxScorePicker:
    def __init__(self, name: str, rng: random.Random) -> None:
        self.name = name
        self._rng = rng

    def pick(self, request: InferenceRequest, scored: list[ScoredEndpoint]) -> list[ScoredEndpoint]:
        ranked = list(scored)
        self._rng.shuffle(ranked)
        ranked.sort(key=lambda s: s.score, reverse=True)  # stable: the shuffle decides ties
        return ranked


def create(name: str, parameters: Mapping[str, Any]) -> MaxScorePicker:
    params = Params(parameters)
    seed = params.integer("seed", None)
    params.done()
    return MaxScorePicker(name, random.Random(seed))
