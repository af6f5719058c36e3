"""The plugin registry the gateway runs with: the in-tree plugins, then installed ones."""

from __future__ import annotations

from gateway.scheduling.framework import PluginKind
from gateway.scheduling.registry import PluginRegistry, load_entry_point_plugins
from policies import register_builtin_plugins

__all__ = ["default_registry"]


def default_registry(load_entry_points: bool = True) -> PluginRegistry:
    """Built-in plugins plus any installed third-party plugin packages."""
    registry = PluginRegistry()
    register_builtin_plugins(registry)
    registry.set_default(PluginKind.PROFILE_HANDLER, "single")  # one profile, as configured
    registry.set_default(PluginKind.PICKER, "max-score")
    if load_entry_points:
        load_entry_point_plugins(registry)
    return registry
