"""Filter ``role``: keep endpoints whose role is in ``roles`` (for prefill/decode pools)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gateway.fleet.endpoint import Endpoint, Role
from gateway.request.types import InferenceRequest
from gateway.scheduling.framework import PluginContext
from policies.params import Params

TYPE_NAME = "role"


class RoleFilter:
    def __init__(self, name: str, roles: frozenset[Role]) -> None:
        self.name = name
        self.roles = roles

    def filter(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> list[Endpoint]:
        return [e for e in candidates if e.role in self.roles]


def create(name: str, parameters: Mapping[str, Any], context: PluginContext) -> RoleFilter:
    params = Params(parameters)
    raw = params.string_list("roles", ["both"])
    params.done()
    try:
        roles = frozenset(Role(value) for value in raw)
    except ValueError:
        raise ValueError(f"parameters.roles: {raw} must be drawn from {[r.value for r in Role]}") from None
    return RoleFilter(name, roles)
