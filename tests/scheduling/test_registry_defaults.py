"""What a config leaves out comes from the registry's defaults, set by the wiring — the
scheduling framework itself knows no plugin by name."""

from __future__ import annotations

import pytest

from gateway.config import PluginSpec, ProfilePluginRef, ProfileSpec, load_config
from gateway.http.app import build_plugin_context
from gateway.http.plugins import default_registry
from gateway.ops.metrics import GatewayMetrics
from gateway.scheduling.build import build_scheduler
from gateway.scheduling.framework import PluginKind
from gateway.scheduling.registry import PluginRegistry


def _context():
    config = load_config(overrides={}, environ={})
    return build_plugin_context(config, GatewayMetrics())


def test_a_profile_without_a_picker_gets_the_registrys_default_picker() -> None:
    registry = default_registry(load_entry_points=False)
    registry.set_default(PluginKind.PICKER, "round-robin")
    plugins = [PluginSpec(type="healthy")]
    profiles = [ProfileSpec(name="default", plugins=[ProfilePluginRef(ref="healthy")])]
    scheduler = build_scheduler(plugins, profiles, registry, _context())
    assert scheduler.profiles["default"].picker.name == "round-robin"
    assert scheduler.handler.name == "single"


def test_a_registry_without_defaults_says_what_is_missing() -> None:
    registry = PluginRegistry()
    with pytest.raises(KeyError, match="no default profile-handler"):
        build_scheduler([], [], registry, _context())


def test_a_default_must_be_of_its_kind() -> None:
    registry = default_registry(load_entry_points=False)
    with pytest.raises(ValueError, match="not a picker"):
        registry.set_default(PluginKind.PICKER, "healthy")
