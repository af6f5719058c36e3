"""The ``models:`` section: model aliases and weighted traffic splits.

```yaml
models:
  chat: llama-3-8b-v1          # an alias: requests for "chat" go to llama-3-8b-v1
  assistant:                   # a split: 90 % to v1, 10 % to v2 (weights are relative)
    - {model: llama-3-8b-v1, weight: 90}
    - {model: llama-3-8b-v2, weight: 10}
```

An alias is a name clients use; its targets are models the fleet serves. Targets are not
aliases themselves (no chains), and a split has at least one positive weight (a weight of
0 keeps a target listed but sends it nothing: how a canary is drained before removal).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field

from gateway.config.base import Strict

__all__ = ["ModelsSection", "WeightedTarget", "alias_targets"]


class WeightedTarget(Strict):
    model: str = Field(min_length=1)
    weight: float = Field(1.0, ge=0, le=1e6)


def alias_targets(route: str | list[WeightedTarget]) -> list[WeightedTarget]:
    """One alias's targets, a plain alias being a split with one target."""
    return [WeightedTarget(model=route)] if isinstance(route, str) else route


def _check(models: dict[str, str | list[WeightedTarget]]) -> dict[str, str | list[WeightedTarget]]:
    for alias, route in models.items():
        if not alias:
            raise ValueError("an alias name may not be empty")
        targets = alias_targets(route)
        if not targets:
            raise ValueError(f"{alias}: give a target model or a list of weighted targets")
        names = [t.model for t in targets]
        if len(set(names)) != len(names):
            raise ValueError(f"{alias}: a target is listed twice")
        if not any(t.weight > 0 for t in targets):
            raise ValueError(f"{alias}: every weight is 0; at least one target must take traffic")
        for name in names:
            if name == alias:
                raise ValueError(f"{alias}: an alias may not target itself")
            if name in models:
                raise ValueError(f"{alias}: target {name!r} is itself an alias (aliases do not chain)")
    return models


ModelsSection = Annotated[dict[str, str | list[WeightedTarget]], AfterValidator(_check)]
