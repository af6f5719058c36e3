"""The plugin interfaces of the scheduler (after the Gateway API Inference Extension).

A scheduling *profile* runs filters in order, then every scorer, then one picker.
Scorers return a raw score in [0, 1] per candidate; the framework — never the
plugin — clamps, multiplies by the configured weight and sums. A *profile handler*
decides which profiles run for a request (one for plain serving; prefill and decode
for disaggregated serving) and which result the proxy uses.

Plugins that need I/O (a Redis-backed index) implement the optional
``prepare`` coroutine, which the framework awaits before scoring; ``score`` itself
is synchronous and must not block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from gateway.fleet.endpoint import Endpoint
from gateway.request.types import InferenceRequest
from gateway.scheduling.result import ScoredEndpoint

if TYPE_CHECKING:
    from gateway.admission.latency_model import LatencyModel
    from gateway.admission.saturation import SaturationDetector
    from gateway.ops.metrics import GatewayMetrics
    from gateway.prefix.cache import PrefixCache
    from gateway.sessions.affinity import SessionAffinity

__all__ = [
    "Filter",
    "Picker",
    "PluginContext",
    "PluginKind",
    "PreparingPlugin",
    "ProfileHandler",
    "Scorer",
]


class PluginKind(StrEnum):
    FILTER = "filter"
    SCORER = "scorer"
    PICKER = "picker"
    PROFILE_HANDLER = "profile-handler"


@dataclass(frozen=True, slots=True)
class PluginContext:
    """App-level services a plugin factory may use (instead of globals)."""

    metrics: GatewayMetrics
    prefix: PrefixCache
    sessions: SessionAffinity
    saturation: SaturationDetector
    latency: LatencyModel | None = None  # the online TTFT/TPOT model (SLO-aware scoring)


class Filter(Protocol):
    """Drops candidates that must not serve this request."""

    name: str

    def filter(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> list[Endpoint]: ...


class Scorer(Protocol):
    """Rates each candidate in [0, 1]; higher is better. Missing candidates score 0."""

    name: str

    def score(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> dict[Endpoint, float]: ...


class Picker(Protocol):
    """Orders the scored candidates: the first is sent to, the rest are retry fallbacks."""

    name: str

    def pick(self, request: InferenceRequest, scored: list[ScoredEndpoint]) -> list[ScoredEndpoint]: ...


@runtime_checkable
class PreparingPlugin(Protocol):
    """Optional hook for plugins that fetch data (e.g. from Redis) before scoring."""

    async def prepare(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> None: ...


class ProfileHandler(Protocol):
    """Chooses which profiles to run and which result to send the request with."""

    name: str

    def pick_profiles(
        self,
        request: InferenceRequest,
        profiles: Sequence[str],
        results: dict[str, list[ScoredEndpoint]],
    ) -> list[str]:
        """Profiles to run next, given the results so far; empty means done."""
        ...

    def primary_profile(self, request: InferenceRequest, results: dict[str, list[ScoredEndpoint]]) -> str:
        """The profile whose ranking the proxy sends the (main/decode) request with."""
        ...

    def prefill_profile(
        self, request: InferenceRequest, results: dict[str, list[ScoredEndpoint]]
    ) -> str | None:
        """The profile whose ranking serves a separate prefill leg (P/D), or None."""
        ...

    def profiles_used(self) -> tuple[str, ...]:
        """Profile names this handler refers to by name; checked against the config at start-up."""
        ...

    def without_candidates(self, request: InferenceRequest, profile: str) -> bool:
        """``profile``'s filters left no endpoint: True to go on without its ranking (it is
        then empty), False to fail the request (503)."""
        ...
