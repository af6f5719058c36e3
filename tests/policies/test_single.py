"""Profile handler ``single``."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, load_config
from gateway.http.app import build_app
from gateway.http.state import STATE
from policies.profiles.single import SingleProfileHandler
from tests.policies.helpers import endpoint, make_plugin, request, scored


def _scheduler(handler_parameters: dict | None):
    plugins = [{"type": "max-score"}, {"type": "round-robin"}]
    if handler_parameters is not None:
        plugins.append({"type": "single", "parameters": handler_parameters})
    profiles = [
        {"name": "first", "plugins": [{"ref": "max-score"}]},
        {"name": "second", "plugins": [{"ref": "round-robin"}]},
    ]
    config = load_config(overrides={"plugins": plugins, "profiles": profiles}, environ={})
    return build_app(config)[STATE].routing.scheduler


def test_runs_the_first_profile_once():
    handler = make_plugin("single")
    req = request()
    assert handler.pick_profiles(req, ["a", "b"], {}) == ["a"]
    results = {"a": scored((endpoint(1), 1.0))}
    assert handler.pick_profiles(req, ["a", "b"], results) == []
    assert handler.primary_profile(req, results) == "a"


def test_profile_parameter_selects_a_profile():
    handler = SingleProfileHandler("under-test", "b")
    assert handler.pick_profiles(request(), ["a", "b"], {}) == ["b"]
    assert handler.profiles_used() == ("b",)


@pytest.mark.parametrize(
    ("params", "profile"), [(None, "first"), ({}, "first"), ({"profile": "second"}, "second")]
)
async def test_through_the_scheduler(params, profile):
    scheduler = _scheduler(params)
    result = await scheduler.schedule(request(), [endpoint(1), endpoint(2)])
    assert list(result.profile_results) == [profile]
    assert result.primary_profile == profile


@pytest.mark.parametrize("params", [{"profile": 5}, {"profiles": ["a"]}])
def test_bad_parameters_name_the_key(params):
    key = next(iter(params))
    with pytest.raises(ConfigError, match=rf"plugins\.\d\.parameters\.{key}"):
        _scheduler(params)


def test_unknown_profile_is_a_config_error():
    with pytest.raises(ConfigError, match="profile"):
        _scheduler({"profile": "nope"})
