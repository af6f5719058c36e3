"""Turns plugin instances and profiles into a Scheduler.

Runs at start-up (and on reload), so unknown plugin types, plugins used in the wrong
place and bad parameters fail before the first request, with the config key in the
message. Knows no plugin by name: what a config leaves out (the profile handler, a
profile's picker) is the registry's default, which the wiring sets.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.config import ConfigError, PluginSpec, ProfileSpec
from gateway.scheduling.framework import PluginContext, PluginKind
from gateway.scheduling.registry import PluginRegistry
from gateway.scheduling.scheduler import Profile, Scheduler, WeightedScorer

__all__ = ["build_scheduler"]


def build_scheduler(
    plugin_specs: Sequence[PluginSpec],
    profile_specs: Sequence[ProfileSpec],
    registry: PluginRegistry,
    context: PluginContext,
) -> Scheduler:
    instances: dict[str, tuple[PluginKind, Any]] = {}
    for index, spec in enumerate(plugin_specs):
        try:
            plugin_type = registry.get(spec.type)
        except KeyError as exc:
            raise ConfigError(f"plugins.{index}.type: {exc.args[0]}") from None
        try:
            instance = plugin_type.factory(spec.instance_name, spec.parameters, context)
        except ValueError as exc:
            raise ConfigError(f"plugins.{index}.{exc}") from None
        instances[spec.instance_name] = (plugin_type.kind, instance)

    handlers = [inst for kind, inst in instances.values() if kind is PluginKind.PROFILE_HANDLER]
    if len(handlers) > 1:
        raise ConfigError("plugins: at most one profile handler may be configured")
    if handlers:
        handler = handlers[0]
    else:
        default = registry.default(PluginKind.PROFILE_HANDLER)
        handler = default.factory(default.type_name, {}, context)

    profiles: dict[str, Profile] = {}
    for p_index, spec in enumerate(profile_specs):
        filters, scorers, pickers = [], [], []
        for r_index, ref in enumerate(spec.plugins):
            kind, instance = instances[ref.ref]
            if kind is PluginKind.FILTER:
                filters.append(instance)
            elif kind is PluginKind.SCORER:
                scorers.append(WeightedScorer(instance, ref.weight))
            elif kind is PluginKind.PICKER:
                pickers.append(instance)
            else:
                raise ConfigError(
                    f"profiles.{p_index}.plugins.{r_index}.ref: {ref.ref!r} is a {kind.value},"
                    " which belongs in plugins, not in a profile"
                )
        if len(pickers) > 1:
            raise ConfigError(f"profiles.{p_index}.plugins: a profile takes one picker, got {len(pickers)}")
        if pickers:
            picker = pickers[0]
        else:
            default = registry.default(PluginKind.PICKER)
            picker = default.factory(default.type_name, {}, context)
        if spec.name in profiles:
            raise ConfigError(f"profiles.{p_index}.name: duplicate profile {spec.name!r}")
        profiles[spec.name] = Profile(spec.name, tuple(filters), tuple(scorers), picker)
    for name in handler.profiles_used():
        if name not in profiles:
            raise ConfigError(
                f"plugins: profile handler {handler.name!r} names unknown profile {name!r}"
                f" (defined: {sorted(profiles)})"
            )
    return Scheduler(profiles, handler, context.metrics)
