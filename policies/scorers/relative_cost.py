"""Costs to scores for the cost-model scorers (``prefix-cost``, ``kv-block-cost``).

score = min cost / cost: 1 for the cheapest candidate, in (0, 1] for the rest, and a ratio
rather than a min-max span so that twice the cost is half the score whatever the others
cost (a min-max span would make the second-cheapest of two always 0).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

__all__ = ["relative_scores"]

K = TypeVar("K")


def relative_scores(costs: Mapping[K, float]) -> dict[K, float]:
    """``min cost / cost`` per key; every cost must be positive (callers add a floor)."""
    best = min(costs.values(), default=0.0)
    return {key: best / cost for key, cost in costs.items()}
