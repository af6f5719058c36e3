"""Prefix-aware routing beats round-robin on the engines' own prefix-cache counters."""

from __future__ import annotations

import pytest

from loadtest.realvllm.bench import RunResult, Workload, format_table, reset_prefix_caches, run_workload
from tests.e2e_vllm.conftest import Fleet
from tests.support.harness import wait_idle

pytestmark = pytest.mark.slow


async def _run(policy: str, fleet: Fleet, start_gateway, http) -> RunResult:
    gw = await start_gateway(fleet.urls, policy=policy)
    await reset_prefix_caches(http, fleet.urls)  # same workload, each policy from a cold cache
    result = await run_workload(http, gw.url, fleet.urls, Workload(), policy)
    await wait_idle(http, gw, within_s=3.0)
    return result


async def test_prefix_aware_gets_more_engine_cache_hits_than_round_robin(
    fleet: Fleet, start_gateway, http
) -> None:
    aware = await _run("prefix-aware", fleet, start_gateway, http)
    spray = await _run("round-robin", fleet, start_gateway, http)
    print("\n" + format_table([aware, spray]))
    for r in (aware, spray):
        assert r.failures == [], r.failures
        # The engine counts every prompt token as a query and every cached one as a hit, the
        # same numbers it reports in usage: the two views of the cache must agree.
        assert sum(r.queries.values()) == r.prompt_tokens
        assert sum(r.hits.values()) == r.cached_tokens
        assert all(q > 0 for q in r.queries.values()), f"{r.policy} left a replica idle: {r.queries}"
    assert aware.hit_ratio >= 0.5
    assert aware.hit_ratio > spray.hit_ratio + 0.3, format_table([aware, spray])
