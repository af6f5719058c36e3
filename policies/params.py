"""Strict reading of a plugin's ``parameters`` mapping: unknown or mistyped keys fail at start-up."""

from __future__ import annotations

import math
import reprlib
from collections.abc import Mapping
from typing import Any

__all__ = ["Params"]

_short = reprlib.Repr()  # Python 3.11: no keyword arguments
_short.maxlevel, _short.maxlist, _short.maxdict, _short.maxstring, _short.maxother = 3, 6, 6, 80, 80


def _shown(value: Any) -> str:
    """A value for an error message, bounded: a config value can be huge (YAML aliases)."""
    return _short.repr(value)


class Params:
    def __init__(self, mapping: Mapping[str, Any]) -> None:
        self._values = dict(mapping)
        self._seen: set[str] = set()

    def number(
        self, key: str, default: float, *, low: float | None = None, high: float | None = None
    ) -> float:
        self._seen.add(key)
        value = self._values.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"parameters.{key}: expected a number, got {_shown(value)}")
        if not math.isfinite(value):  # NaN passes every comparison: a NaN tolerance tied nothing
            raise ValueError(f"parameters.{key}: expected a finite number, got {value}")
        if (low is not None and value < low) or (high is not None and value > high):
            raise ValueError(f"parameters.{key}: {value} is outside [{low}, {high}]")
        return float(value)

    def integer(self, key: str, default: int | None, *, low: int | None = None) -> int | None:
        self._seen.add(key)
        value = self._values.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"parameters.{key}: expected an integer, got {_shown(value)}")
        if low is not None and value < low:
            raise ValueError(f"parameters.{key}: {value} is below {low}")
        return value

    def boolean(self, key: str, default: bool) -> bool:
        self._seen.add(key)
        value = self._values.get(key, default)
        if not isinstance(value, bool):
            raise ValueError(f"parameters.{key}: expected true or false, got {_shown(value)}")
        return value

    def choice(self, key: str, default: str, choices: tuple[str, ...]) -> str:
        self._seen.add(key)
        value = self._values.get(key, default)
        if value not in choices:
            raise ValueError(f"parameters.{key}: {_shown(value)} is not one of {list(choices)}")
        return value

    def string_list(self, key: str, default: list[str]) -> list[str]:
        self._seen.add(key)
        value = self._values.get(key, default)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"parameters.{key}: expected a list of strings, got {_shown(value)}")
        return value

    def optional_string(self, key: str) -> str | None:
        self._seen.add(key)
        value = self._values.get(key)
        if value is not None and not isinstance(value, str):
            raise ValueError(f"parameters.{key}: expected a string, got {_shown(value)}")
        return value

    def done(self) -> None:
        """Call after reading every parameter: anything left over is a typo in the config."""
        unknown = sorted(set(self._values) - self._seen)
        if unknown:
            raise ValueError(f"parameters.{unknown[0]}: unknown parameter (known: {sorted(self._seen)})")
