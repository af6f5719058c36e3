"""The base of every config section: strict (unknown keys are errors) and frozen."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["ConfigError", "Strict"]


class ConfigError(ValueError):
    """Invalid configuration; the message names the key."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
