"""Model aliases and weighted traffic splits (config ``models:``): the body's model rewritten.

A request for an alias gets one of its targets, by weight; the body's ``model`` is
rewritten (:func:`~gateway.admission.rewrite.rewrite_body`, as degrade's model switch) so
the engine sees the model it serves. A request with a session keeps one target for the
whole session (the choice is a hash of the session id, so a conversation does not flip
between model versions and lose its KV cache); one without draws at random. A Responses
continuation picks among the targets the replica storing its chain serves (``serves``): the
chain cannot move, so neither may its model. Targets with
no healthy endpoint are skipped while another can serve. Weights change on a config
reload (:meth:`ModelAliases.reconfigure`); counted per alias and target in
``llm_gateway_model_alias_requests_total``.
"""

from __future__ import annotations

import bisect
import random
import zlib
from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter

from gateway.admission.rewrite import rewrite_body
from gateway.config.models import WeightedTarget, alias_targets
from gateway.request.types import InferenceRequest

__all__ = ["ModelAliases", "Split"]


class Split:
    """One alias's targets and their cumulative weights (zero-weight targets are never drawn)."""

    __slots__ = ("_bounds", "models", "total", "weights")

    def __init__(self, targets: list[WeightedTarget]) -> None:
        live = [t for t in targets if t.weight > 0]
        self.models = [t.model for t in live]
        self.weights = [t.weight for t in live]
        self._bounds: list[float] = []
        running = 0.0
        for target in live:
            running += target.weight
            self._bounds.append(running)
        self.total = running

    def pick(self, point: float, usable: Callable[[str], bool]) -> str:
        """The target at ``point`` (in [0, 1)); if it cannot serve, the split among those that can."""
        chosen = self.models[min(bisect.bisect_right(self._bounds, point * self.total), len(self.models) - 1)]
        if len(self.models) == 1 or usable(chosen):
            return chosen
        serving = [(m, w) for m, w in zip(self.models, self.weights, strict=True) if usable(m)]
        if not serving:
            return chosen  # nobody can: the chosen target's 503 says why
        total = sum(w for _, w in serving)
        mark = point * total
        for model, weight in serving:
            if mark < weight:
                return model
            mark -= weight
        return serving[-1][0]


class ModelAliases:
    def __init__(
        self,
        models: Mapping[str, str | list[WeightedTarget]],
        registry: CollectorRegistry,
        usable: Callable[[str], bool],
    ) -> None:
        self._usable = usable
        self._rng = random.Random()
        self._counter = Counter(
            "llm_gateway_model_alias_requests",
            "Requests for a model alias, by the target they were sent to",
            ["alias", "target"],
            registry=registry,
        )
        self._splits: dict[str, Split] = {}
        self.reconfigure(models)

    def reconfigure(self, models: Mapping[str, str | list[WeightedTarget]]) -> None:
        """New aliases and weights, for the next request (one assignment: no request sees half)."""
        self._splits = {alias: Split(alias_targets(route)) for alias, route in models.items()}
        for alias, split in self._splits.items():
            for target in split.models:
                self._counter.labels(alias, target)  # exported at 0 from the start

    def __bool__(self) -> bool:
        return bool(self._splits)

    def is_alias(self, model: str) -> bool:
        return model in self._splits

    def resolve(self, request: InferenceRequest, serves: Callable[[str], bool] | None = None) -> str | None:
        """Rewrite an alias to one of its targets; returns the target (None: not an alias).

        ``serves``: only targets it accepts (a stored chain's replica), unless it accepts none.
        """
        split = self._splits.get(request.model)
        if split is None:
            return None
        if request.session_id:
            point = zlib.crc32(request.session_id.encode()) / 2**32
        else:
            point = self._rng.random()
        usable = self._usable
        if serves is not None and any(serves(m) for m in split.models):
            usable = serves
        target = split.pick(point, usable)
        self._counter.labels(request.model, target).inc()
        request.body["model"] = target
        request.model = target
        rewrite_body(request)
        return target

    def listed(self, served: Iterable[str]) -> list[str]:
        """The aliases to list next to ``served`` models: those with a target among them."""
        serving = set(served)
        return [alias for alias, split in self._splits.items() if serving.intersection(split.models)]
