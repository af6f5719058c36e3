"""Turns the config's plugin instances and profiles (or a named preset) into a Scheduler.

Runs at start-up, so unknown plugin types, plugins used in the wrong place and bad
parameters fail before the first request, with the config key in the message.
"""

from __future__ import annotations

from typing import Any

from gateway.config import ConfigError, GatewayConfig, PluginSpec, ProfilePluginRef, ProfileSpec
from gateway.scheduling.framework import PluginContext, PluginKind
from gateway.scheduling.registry import PluginRegistry
from gateway.scheduling.scheduler import Profile, Scheduler, WeightedScorer

__all__ = ["DEFAULT_POLICY", "PRESETS", "build_scheduler", "pd_preset", "preset"]

_BASE_FILTERS = (PluginSpec(type="healthy"), PluginSpec(type="model"))
_TIE_BREAK = PluginSpec(type="max-score", parameters={"tolerance": 0.02})


def _preset(
    picker: PluginSpec, *scorers: tuple[PluginSpec, float]
) -> tuple[list[PluginSpec], list[ProfileSpec]]:
    """One profile: the base filters, the weighted scorers, the picker."""
    plugins = [*_BASE_FILTERS, *(spec for spec, _ in scorers), picker]
    refs = [
        *(ProfilePluginRef(ref=f.instance_name) for f in _BASE_FILTERS),
        *(ProfilePluginRef(ref=spec.instance_name, weight=weight) for spec, weight in scorers),
        ProfilePluginRef(ref=picker.instance_name),
    ]
    return plugins, [ProfileSpec(name="default", plugins=refs)]


# Named presets: what `--policy NAME` means without a config file.
PRESETS: dict[str, tuple[list[PluginSpec], list[ProfileSpec]]] = {
    "round-robin": _preset(PluginSpec(type="round-robin")),
    "random": _preset(PluginSpec(type="random")),
    "least-load": _preset(
        PluginSpec(type="max-score"),
        (PluginSpec(type="queue-depth"), 1),
        (PluginSpec(type="kv-utilization"), 1),
        (PluginSpec(type="in-flight"), 1),
    ),
    # Expected-cost routing: prefix hits against queued work; cache room breaks cold ties.
    "prefix-aware": _preset(
        _TIE_BREAK, (PluginSpec(type="prefix-cost"), 1), (PluginSpec(type="cache-room"), 0.1)
    ),
    # prefix-aware plus session stickiness: a conversation stays on its replica while it has room.
    "session-aware": _preset(
        _TIE_BREAK,
        (PluginSpec(type="prefix-cost"), 1),
        (PluginSpec(type="cache-room"), 0.1),
        (PluginSpec(type="session-affinity"), 0.5),
    ),
}
DEFAULT_POLICY = "prefix-aware"


def pd_preset(config: GatewayConfig) -> tuple[list[PluginSpec], list[ProfileSpec]]:
    """Two pools: decode (prefix cost, session affinity) and prefill (prefix cost), under ``pd-disagg``."""
    plugins = [
        *_BASE_FILTERS,
        PluginSpec(type="role", name="decode-pool", parameters={"roles": ["decode", "both"]}),
        PluginSpec(type="role", name="prefill-pool", parameters={"roles": ["prefill"]}),
        PluginSpec(type="prefix-cost"),
        PluginSpec(type="session-affinity"),
        PluginSpec(type="kv-utilization"),
        _TIE_BREAK,
        PluginSpec(
            type="pd-disagg",
            parameters={"decider": config.pd.decider, "threshold_tokens": config.pd.threshold_tokens},
        ),
    ]
    common = [ProfilePluginRef(ref="healthy"), ProfilePluginRef(ref="model")]
    decode = ProfileSpec(
        name="decode",
        plugins=[
            *common,
            ProfilePluginRef(ref="decode-pool"),
            ProfilePluginRef(ref="prefix-cost", weight=1),
            ProfilePluginRef(ref="kv-utilization", weight=0.2),
            ProfilePluginRef(ref="session-affinity", weight=0.5),
            ProfilePluginRef(ref="max-score"),
        ],
    )
    prefill = ProfileSpec(
        name="prefill",
        plugins=[
            *common,
            ProfilePluginRef(ref="prefill-pool"),
            ProfilePluginRef(ref="prefix-cost", weight=1),
            ProfilePluginRef(ref="max-score"),
        ],
    )
    return plugins, [decode, prefill]


def preset(name: str) -> tuple[list[PluginSpec], list[ProfileSpec]]:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"policy: unknown preset {name!r} (known: {', '.join(sorted(PRESETS))})") from None


def build_scheduler(config: GatewayConfig, registry: PluginRegistry, context: PluginContext) -> Scheduler:
    if config.plugins:
        plugin_specs, profile_specs = config.plugins, config.profiles
    elif any(e.role == "prefill" for e in config.endpoints) and config.policy is None:
        plugin_specs, profile_specs = pd_preset(config)
    else:
        plugin_specs, profile_specs = preset(config.policy or DEFAULT_POLICY)

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
        handler = registry.get("single").factory("single", {}, context)

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
        picker = pickers[0] if pickers else registry.get("max-score").factory("max-score", {}, context)
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
