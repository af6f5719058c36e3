"""Registry of plugin *types*: type name → (kind, factory). Config instances are built from it.

The wiring registers the in-tree plugins (:mod:`gateway.http.plugins`); third-party
packages add theirs through the ``llm_gateway.plugins`` entry-point group, whose entry
points are callables ``register(registry: PluginRegistry) -> None``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from gateway.scheduling.framework import PluginContext, PluginKind

__all__ = ["ENTRY_POINT_GROUP", "PluginFactory", "PluginRegistry", "PluginType", "load_entry_point_plugins"]

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "llm_gateway.plugins"

# A factory takes the instance name, its parameters and the app's shared services.
PluginFactory = Callable[[str, Mapping[str, Any], "PluginContext"], Any]


@dataclass(frozen=True, slots=True)
class PluginType:
    type_name: str
    kind: PluginKind
    factory: PluginFactory


class PluginRegistry:
    """Plugin types by name, and which of them fill in what a config leaves out.

    The defaults (the profile handler when none is configured, the picker of a profile
    that names none) are the wiring's choice, set with :meth:`set_default`: the framework
    knows no plugin by name.
    """

    def __init__(self) -> None:
        self._types: dict[str, PluginType] = {}
        self._defaults: dict[PluginKind, str] = {}

    def set_default(self, kind: PluginKind, type_name: str) -> None:
        if self.get(type_name).kind is not kind:
            raise ValueError(f"plugin type {type_name!r} is not a {kind.value}")
        self._defaults[kind] = type_name

    def default(self, kind: PluginKind) -> PluginType:
        try:
            return self.get(self._defaults[kind])
        except KeyError:
            raise KeyError(f"no default {kind.value} is registered") from None

    def register(self, type_name: str, kind: PluginKind, factory: PluginFactory) -> None:
        if type_name in self._types:
            raise ValueError(f"plugin type {type_name!r} is already registered")
        self._types[type_name] = PluginType(type_name, kind, factory)

    def get(self, type_name: str) -> PluginType:
        try:
            return self._types[type_name]
        except KeyError:
            raise KeyError(
                f"unknown plugin type {type_name!r} (known: {', '.join(sorted(self._types))})"
            ) from None

    def __contains__(self, type_name: object) -> bool:
        return type_name in self._types

    def type_names(self) -> list[str]:
        return sorted(self._types)


def load_entry_point_plugins(registry: PluginRegistry) -> None:
    """Let installed third-party packages register theirs (``llm_gateway.plugins`` entry points)."""
    for entry_point in entry_points(group=ENTRY_POINT_GROUP):
        log.info("loading plugins from %s", entry_point.value)
        entry_point.load()(registry)
