"""Third-party plugins arrive through the ``llm_gateway.plugins`` entry-point group.

The test installs a real (minimal) distribution on ``sys.path`` — a package plus a
``.dist-info`` with ``entry_points.txt`` — so ``importlib.metadata`` finds it exactly
as it would find a pip-installed plugin package.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from gateway.config import load_config
from gateway.http.app import build_plugin_context
from gateway.http.plugins import default_registry
from gateway.http.presets import scheduler_specs
from gateway.ops.metrics import GatewayMetrics
from gateway.scheduling.build import build_scheduler
from gateway.scheduling.framework import PluginKind
from gateway.scheduling.registry import ENTRY_POINT_GROUP
from tests.policies.helpers import endpoint, request

PLUGIN_SOURCE = textwrap.dedent(
    """
    from gateway.scheduling.framework import PluginKind


    class PreferHost2:
        def __init__(self, name):
            self.name = name

        def score(self, request, candidates):
            return {e: 1.0 if "//10.0.0.2:" in e.url else 0.0 for e in candidates}


    def create(name, params, context):
        return PreferHost2(name)


    def register(registry):
        registry.register("prefer-host-2", PluginKind.SCORER, create)
    """
)


@pytest.fixture
def installed_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "acme_router_plugin.py").write_text(PLUGIN_SOURCE)
    dist = tmp_path / "acme_router_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-router-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nacme = acme_router_plugin:register\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def test_installed_plugin_is_registered_and_used_from_config(installed_plugin: None) -> None:
    registry = default_registry()
    assert registry.get("prefer-host-2").kind is PluginKind.SCORER
    config = load_config(
        overrides={
            "plugins": [{"type": "prefer-host-2"}, {"type": "max-score"}],
            "profiles": [{"name": "default", "plugins": [{"ref": "prefer-host-2"}, {"ref": "max-score"}]}],
        },
        environ={},
    )
    scheduler = build_scheduler(
        *scheduler_specs(config), registry, build_plugin_context(config, GatewayMetrics())
    )
    assert scheduler.profiles["default"].scorers[0].scorer.name == "prefer-host-2"


async def test_installed_plugin_decides(installed_plugin: None) -> None:
    config = load_config(
        overrides={
            "plugins": [{"type": "prefer-host-2"}, {"type": "max-score"}],
            "profiles": [{"name": "default", "plugins": [{"ref": "prefer-host-2"}, {"ref": "max-score"}]}],
        },
        environ={},
    )
    scheduler = build_scheduler(
        *scheduler_specs(config), default_registry(), build_plugin_context(config, GatewayMetrics())
    )
    fleet = [endpoint(1), endpoint(2), endpoint(3)]
    for _ in range(12):  # without the plugin's scores the picker would choose at random
        result = await scheduler.schedule(request(), fleet)
        assert result.ranked[0].endpoint is fleet[1]


def test_without_the_package_the_type_is_unknown() -> None:
    with pytest.raises(KeyError, match="prefer-host-2"):
        default_registry().get("prefer-host-2")
