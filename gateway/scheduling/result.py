"""What the scheduler hands the proxy: ranked candidates per profile, and the P/D decision."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.fleet.endpoint import Endpoint

__all__ = ["PDDecision", "SchedulingResult", "ScoredEndpoint"]


@dataclass(frozen=True, slots=True)
class PDDecision:
    """The profile handler's verdict on prefill/decode disaggregation, and why."""

    disaggregate: bool
    reason: str


@dataclass(slots=True)
class ScoredEndpoint:
    endpoint: Endpoint
    score: float
    scores: dict[str, float] = field(default_factory=dict)

    def explain(self) -> str:
        parts = ",".join(f"{name}={value:.3f}" for name, value in self.scores.items())
        return f"{self.endpoint.name}={self.score:.3f}({parts})"


@dataclass(slots=True)
class SchedulingResult:
    """Per-profile ranked candidates; ``primary_profile`` names the one the proxy sends to,
    ``prefill_profile`` the one a separate prefill leg goes to."""

    profile_results: dict[str, list[ScoredEndpoint]]
    primary_profile: str
    prefill_profile: str | None = None  # set when the request is disaggregated (P/D)

    @property
    def ranked(self) -> list[ScoredEndpoint]:
        return self.profile_results[self.primary_profile]

    @property
    def prefill_ranked(self) -> list[ScoredEndpoint] | None:
        return self.profile_results[self.prefill_profile] if self.prefill_profile else None

    def explain(self) -> str:
        return " | ".join(
            f"{profile}: " + "; ".join(s.explain() for s in ranked)
            for profile, ranked in self.profile_results.items()
        )
