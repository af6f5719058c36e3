"""``admission.slo``: latency objectives per request, the online latency model, SLO shedding."""

from __future__ import annotations

from pydantic import Field, field_validator

from gateway.config.base import Strict, refuse_boolean
from gateway.request.types import Priority

__all__ = ["SloConfig", "SloTarget"]


class SloTarget(Strict):
    ttft_ms: float | None = Field(None, gt=0, le=3_600_000, description="time to first token objective")
    tpot_ms: float | None = Field(None, gt=0, le=3_600_000, description="time per output token objective")

    _numbers = field_validator("ttft_ms", "tpot_ms", mode="before")(refuse_boolean)


class SloConfig(Strict):
    ttft_header: str = "x-slo-ttft-ms"
    tpot_header: str = "x-slo-tpot-ms"
    defaults: dict[Priority, SloTarget] = Field(
        default_factory=dict,
        description="objectives for requests that send no x-slo-* header, by priority; none by default",
    )
    shed_sheddable: bool = Field(
        True, description="refuse (429) sheddable requests that no replica is predicted to serve in time"
    )
    hold_standard: bool = Field(
        True,
        description="a standard request with a TTFT objective waits in the gateway's queue (earliest "
        "deadline first) while no replica is predicted to meet it, instead of joining an engine queue "
        "it would miss its deadline in",
    )
    drop_overdue: bool = Field(
        False,
        description="refuse (429 slo_deadline_passed) a queued standard request once its TTFT deadline "
        "has passed, instead of serving it late: under overload its slot goes to work that can still "
        "meet its objective (goodput); off: late work is served, as without objectives",
    )
    min_samples: int = Field(
        20, ge=1, description="observations a replica's model needs (else the fleet's) before it sheds"
    )
    shed_margin: float = Field(
        1.0, gt=0, description="shed when the best predicted TTFT exceeds the time left × this"
    )
    horizon: int = Field(
        500, ge=10, description="latency model memory, in observations (older ones fade exponentially)"
    )
    training_per_s: float = Field(
        100.0,
        gt=0,
        le=1_000_000,
        description="streamed answers per second that train each replica's model (and as many the "
        "fleet's pooled one); past it answers are sampled, bursts of up to one second's worth "
        "included: at high rates a horizon of observations would span a fraction of a second, and "
        "each observation costs CPU on the request path",
    )

    _rate = field_validator("training_per_s", mode="before")(refuse_boolean)
