"""Tenants: who a key belongs to, what it may call and how fast.

One schema (:class:`TenantSpec`) validates a tenant wherever it is stored — the keys
file and the Redis JSON record — so both backends accept exactly the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.config.base import refuse_boolean
from gateway.request.types import Priority

__all__ = ["TENANT_NAME_PATTERN", "Priority", "Tenant", "TenantSpec"]  # Priority: re-exported


# Tenant names end up inside Redis keys as a hash tag (``{name}``) and in logs and
# metric labels: keep them to a plain, brace-free alphabet.
TENANT_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$"


@dataclass(frozen=True, slots=True)
class Tenant:
    """An authenticated caller. ``key_name`` only says which key matched (for logs); it is not compared."""

    name: str
    priority: Priority = Priority.STANDARD
    models: frozenset[str] = frozenset()  # empty: every model
    requests_per_minute: int = 0  # 0: unlimited
    tokens_per_minute: int = 0  # 0: unlimited
    debug: bool = False  # may see the routing debug header
    slo_ttft_ms: float | None = None  # objectives for its requests that send no x-slo-* header
    slo_tpot_ms: float | None = None
    key_name: str = field(default="", compare=False)

    def allows_model(self, model: str) -> bool:
        return not self.models or model in self.models

    @property
    def slo_objectives(self) -> tuple[float | None, float | None]:
        return self.slo_ttft_ms, self.slo_tpot_ms

    @property
    def limited(self) -> bool:
        return self.requests_per_minute > 0 or self.tokens_per_minute > 0


_MAX_LIMIT = 10**12  # per minute; a larger limit (10**400 loaded, then overflowed a float per request)


class TenantSpec(BaseModel):
    """A tenant as written in the keys file or stored in Redis (its name is the mapping key)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    priority: Priority = Priority.STANDARD
    models: list[str] = Field(default_factory=list, description="allowed models; empty = all")
    requests_per_minute: int = Field(0, ge=0, le=_MAX_LIMIT, description="0 = unlimited")
    tokens_per_minute: int = Field(0, ge=0, le=_MAX_LIMIT, description="0 = unlimited")
    debug: bool = False
    slo_ttft_ms: float | None = Field(
        None, gt=0, le=3_600_000, description="TTFT objective of its requests without x-slo-* headers"
    )
    slo_tpot_ms: float | None = Field(
        None, gt=0, le=3_600_000, description="TPOT objective of its requests without x-slo-* headers"
    )

    _numbers = field_validator("slo_ttft_ms", "slo_tpot_ms", mode="before")(refuse_boolean)

    # ``models:`` or ``requests_per_minute:`` written with no value reads as null: same as missing.
    @field_validator("models", mode="before")
    @classmethod
    def _null_models(cls, value: Any) -> Any:
        return [] if value is None else value

    @field_validator("requests_per_minute", "tokens_per_minute", mode="before")
    @classmethod
    def _null_limit(cls, value: Any) -> Any:
        refuse_boolean(value)  # `requests_per_minute: yes` is a mistake, not 1 a minute
        return 0 if value is None else value

    def to_tenant(self, name: str, key_name: str = "") -> Tenant:
        return Tenant(
            name=name,
            priority=self.priority,
            models=frozenset(self.models),
            requests_per_minute=self.requests_per_minute,
            tokens_per_minute=self.tokens_per_minute,
            debug=self.debug,
            slo_ttft_ms=self.slo_ttft_ms,
            slo_tpot_ms=self.slo_tpot_ms,
            key_name=key_name,
        )

    @classmethod
    def from_tenant(cls, tenant: Tenant) -> TenantSpec:
        return cls(
            priority=tenant.priority,
            models=sorted(tenant.models),
            requests_per_minute=tenant.requests_per_minute,
            tokens_per_minute=tenant.tokens_per_minute,
            debug=tenant.debug,
            slo_ttft_ms=tenant.slo_ttft_ms,
            slo_tpot_ms=tenant.slo_tpot_ms,
        )
