"""The shape of a decoded JSON value, as the body guards count it (tests only)."""

from __future__ import annotations

from typing import Any

__all__ = ["containers", "depth"]


def _children(value: Any) -> list[Any] | None:
    if isinstance(value, dict):
        return list(value.values())
    if isinstance(value, list):
        return value
    return None


def depth(value: Any) -> int:
    """How deep arrays and objects nest (``{}`` is 1, a scalar 0)."""
    children = _children(value)
    return 0 if children is None else 1 + max((depth(v) for v in children), default=0)


def containers(value: Any) -> int:
    """How many arrays and objects, ``value`` itself included."""
    children = _children(value)
    return 0 if children is None else 1 + sum(containers(v) for v in children)
