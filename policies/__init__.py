"""In-tree routing plugins, one small module each, registered by type name."""

from __future__ import annotations

from types import ModuleType

from gateway.scheduling.framework import PluginKind
from gateway.scheduling.registry import PluginRegistry
from policies.filters import healthy, model, role
from policies.pickers import max_score, random_pick, round_robin
from policies.profiles import pd_disagg, single
from policies.scorers import (
    cache_room,
    in_flight,
    kv_block_cost,
    kv_utilization,
    lora_affinity,
    prefix_affinity,
    prefix_cost,
    queue_depth,
    session_affinity,
    session_balance,
    slo_headroom,
)

__all__ = ["BUILTIN_PLUGINS", "register_builtin_plugins"]

BUILTIN_PLUGINS: dict[PluginKind, tuple[ModuleType, ...]] = {
    PluginKind.FILTER: (healthy, model, role),
    PluginKind.SCORER: (
        queue_depth,
        kv_utilization,
        in_flight,
        prefix_affinity,
        prefix_cost,
        kv_block_cost,
        cache_room,
        session_affinity,
        session_balance,
        slo_headroom,
        lora_affinity,
    ),
    PluginKind.PICKER: (max_score, random_pick, round_robin),
    PluginKind.PROFILE_HANDLER: (single, pd_disagg),
}


def register_builtin_plugins(registry: PluginRegistry) -> None:
    for kind, modules in BUILTIN_PLUGINS.items():
        for module in modules:
            registry.register(module.TYPE_NAME, kind, module.create)
