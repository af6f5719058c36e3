"""Filter ``model``: only endpoints that serve the requested model."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gateway.fleet.endpoint import Endpoint
from gateway.request.types import InferenceRequest
from gateway.scheduling.framework import PluginContext
from policies.params import Params

TYPE_NAME = "model"


class ModelFilter:
    def __init__(self, name: str) -> None:
        self.name = name

    def filter(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> list[Endpoint]:
        return [e for e in candidates if e.serves(request.model)]


def create(name: str, parameters: Mapping[str, Any], context: PluginContext) -> ModelFilter:
    Params(parameters).done()
    return ModelFilter(name)
