"""Tenants: who a key belongs to, what it may call and how fast.

One schema (:class:`TenantSpec`) validates a tenant wherever it is stored — the keys
file and the Redis JSON record — so both backends accept exactly the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.request.types import Priority

__all__ = ["TENANT_NAME_PATTERN", "Priority", "Tenant", "TenantSpec"]  # Priority: re-exported


# Tenant names end up inside Redis keys as a hash tag (``{name}``) and in logs and
# metric labels: keep them to a plain, brace-free alphabet.
TENANT_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$"


@dataclass(frozen=True, slots=True)
class Tenant:
    """An authenticated caller. ``key_name`` only says which key matched (for logs); it is not compared."""

    name: str
    priority: Priority = "standard"
    models: frozenset[str] = frozenset()  # empty: every model
    requests_per_minute: int = 0  # 0: unlimited
    tokens_per_minute: int = 0  # 0: unlimited
    debug: bool = False  # may see the routing debug header
    key_name: str = field(default="", compare=False)

    def allows_model(self, model: str) -> bool:
        return not self.models or model in self.models

    @property
    def limited(self) -> bool:
        return self.requests_per_minute > 0 or self.tokens_per_minute > 0


class TenantSpec(BaseModel):
    """A tenant as written in the keys file or stored in Redis (its name is the mapping key)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    priority: Priority = "standard"
    models: list[str] = Field(default_factory=list, description="allowed models; empty = all")
    requests_per_minute: int = Field(0, ge=0, description="0 = unlimited")
    tokens_per_minute: int = Field(0, ge=0, description="0 = unlimited")
    debug: bool = False

    # ``models:`` or ``requests_per_minute:`` written with no value reads as null: same as missing.
    @field_validator("models", mode="before")
    @classmethod
    def _null_models(cls, value: Any) -> Any:
        return [] if value is None else value

    @field_validator("requests_per_minute", "tokens_per_minute", mode="before")
    @classmethod
    def _null_limit(cls, value: Any) -> Any:
        return 0 if value is None else value

    def to_tenant(self, name: str, key_name: str = "") -> Tenant:
        return Tenant(
            name=name,
            priority=self.priority,
            models=frozenset(self.models),
            requests_per_minute=self.requests_per_minute,
            tokens_per_minute=self.tokens_per_minute,
            debug=self.debug,
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
        )
