"""The base of every config section: strict (unknown keys are errors) and frozen."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

__all__ = ["ConfigError", "Strict", "refuse_boolean"]


class ConfigError(ValueError):
    """Invalid configuration; the message names the key."""


class Strict(BaseModel):
    # No inf or NaN anywhere: ``retry_after_s: .inf`` passed ``gt=0`` and then broke every 429.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def refuse_boolean(value: Any) -> Any:
    """A ``mode="before"`` validator: YAML's ``true`` where a number belongs is a mistake, not
    the 1 that pydantic's lax float mode makes of it (a 1 ms objective)."""
    if isinstance(value, bool):
        raise ValueError("a number is expected here, not a boolean")
    return value
