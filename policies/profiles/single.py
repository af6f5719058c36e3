"""Profile handler ``single``: run one profile (the first configured) and send with it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gateway.request.types import InferenceRequest
from gateway.scheduling.framework import PluginContext
from gateway.scheduling.result import ScoredEndpoint
from policies.params import Params

TYPE_NAME = "single"


class SingleProfileHandler:
    def __init__(self, name: str, profile: str | None) -> None:
        self.name = name
        self.profile = profile

    def pick_profiles(
        self,
        request: InferenceRequest,
        profiles: Sequence[str],
        results: dict[str, list[ScoredEndpoint]],
    ) -> list[str]:
        if results:
            return []
        return [self.profile or profiles[0]]

    def profiles_used(self) -> tuple[str, ...]:
        return (self.profile,) if self.profile else ()

    def prefill_profile(
        self, request: InferenceRequest, results: dict[str, list[ScoredEndpoint]]
    ) -> str | None:
        return None

    def primary_profile(self, request: InferenceRequest, results: dict[str, list[ScoredEndpoint]]) -> str:
        return next(iter(results))

    def without_candidates(self, request: InferenceRequest, profile: str) -> bool:
        return False  # its one profile is the request's: nothing to send it to


def create(name: str, parameters: Mapping[str, Any], context: PluginContext) -> SingleProfileHandler:
    params = Params(parameters)
    profile = params.optional_string("profile")
    params.done()
    return SingleProfileHandler(name, profile)
