"""A plugin that raises: a scorer or preparer costs its own say in the request, never the
request; a filter (a constraint: a pool's role, residency) fails closed (review findings).

A third-party scorer that divided by zero for some prompt lengths made those requests 500s;
a filter that raised, let through, sent requests where the constraint forbade. Each failure
is logged with its traceback once a minute. Real gateway, real replicas.
"""

from __future__ import annotations

import logging

import pytest

from gateway.http.plugins import default_registry
from gateway.scheduling.framework import PluginKind
from tests.support.harness import wait_until


class _Broken:
    def __init__(self, name: str) -> None:
        self.name = name

    async def prepare(self, request, candidates) -> None:
        raise RuntimeError("prepare broke")

    def score(self, request, candidates):
        return {e: 1.0 / (len(request.prompt_text) % 3) for e in candidates}  # ZeroDivisionError at times

    def filter(self, request, candidates):
        raise RuntimeError("filter broke")


@pytest.mark.parametrize("kind", [PluginKind.SCORER, PluginKind.FILTER])
async def test_a_failing_plugin_is_skipped_or_fails_closed(
    start_upstream, start_gateway, http, caplog, kind
) -> None:
    registry = default_registry(load_entry_points=False)
    registry.register("broken", kind, lambda name, params, ctx: _Broken(name))
    broken = {"ref": "broken", "weight": 0.5} if kind is PluginKind.SCORER else {"ref": "broken"}
    plugins = [{"type": "healthy"}, {"type": "in-flight"}, {"type": "broken"}, {"type": "max-score"}]
    profiles = [
        {
            "name": "default",
            "plugins": [{"ref": "healthy"}, broken, {"ref": "in-flight"}, {"ref": "max-score"}],
        }
    ]
    upstreams = [await start_upstream(models=("m",)) for _ in range(2)]
    gw = await start_gateway(
        [u.url for u in upstreams], plugin_registry=registry, plugins=plugins, profiles=profiles
    )

    async def healthy() -> bool:
        return all(e.healthy and e.models for e in gw.state.registry)

    await wait_until(healthy, 5.0, "both replicas healthy")
    statuses = []
    with caplog.at_level(logging.ERROR, logger="gateway.scheduling.scheduler"):
        for i in range(12):
            body = {"model": "m", "messages": [{"role": "user", "content": "x" * i}], "max_tokens": 2}
            async with http.post(gw.url + "/v1/chat/completions", json=body) as resp:
                statuses.append(resp.status)
    if kind is PluginKind.SCORER:
        assert statuses == [200] * 12  # old: a 500 for every prompt length the plugin failed on
    else:  # a filter that raises leaves no candidate: 503, never a replica it might have excluded
        assert statuses == [503] * 12
    failures = [r for r in caplog.records if "plugin 'broken' failed" in r.getMessage()]
    assert len(failures) == 1  # logged with its traceback, once a minute, not once a request
    assert failures[0].exc_info is not None
