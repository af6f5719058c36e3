"""A reload that changes the routing policy swaps the hook chain with the scheduler.

Regression: the hooks used to be chosen once at start-up (the prefix hook only when the
starting policy read the index), and a reload swapped only the scheduler — so after
``least-load`` → ``prefix-aware`` the prefix index was never filled and prefix routing
silently never happened.
"""

from __future__ import annotations

import yaml

from gateway.http.reload import ConfigReloader

SYSTEM = "You are a careful assistant. " * 200  # ~5.8 KB: many index blocks


def _body(question: str) -> dict:
    return {
        "model": "m",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 4,
    }


async def test_reload_to_prefix_aware_fills_the_index_and_routes_by_it(
    start_sim, start_gateway, http, tmp_path
):
    sims = [await start_sim(model="m") for _ in range(3)]
    urls = [s.url for s in sims]
    gw = await start_gateway(urls, policy="least-load")
    state = gw.state
    assert not state.routing.scheduler.preparers

    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump({"endpoints": [{"url": u} for u in urls], "policy": "least-load"}))
    reloader = ConfigReloader(state, path)
    path.write_text(yaml.safe_dump({"endpoints": [{"url": u} for u in urls], "policy": "prefix-aware"}))
    assert await reloader.reload() == "applied"
    assert state.routing.scheduler.preparers  # the new policy reads the index …

    served = []
    for i in range(6):
        async with http.post(gw.url + "/v1/chat/completions", json=_body(f"question {i}")) as resp:
            assert resp.status == 200
            served.append(resp.headers["x-gateway-endpoint"])
    # … and the new hooks fill it: the first request's replica is recorded,
    recorded = {e.name: state.prefix.size(e) for e in state.registry}
    assert recorded[served[0]] > 0, recorded
    # … so every later request with the same long prefix follows it there.
    assert served == [served[0]] * 6


async def test_reload_back_to_least_load_stops_hashing(start_sim, start_gateway, http, tmp_path):
    sims = [await start_sim(model="m") for _ in range(2)]
    urls = [s.url for s in sims]
    gw = await start_gateway(urls, policy="prefix-aware")
    state = gw.state
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump({"endpoints": [{"url": u} for u in urls], "policy": "prefix-aware"}))
    reloader = ConfigReloader(state, path)
    path.write_text(yaml.safe_dump({"endpoints": [{"url": u} for u in urls], "policy": "least-load"}))
    assert await reloader.reload() == "applied"
    async with http.post(gw.url + "/v1/chat/completions", json=_body("q")) as resp:
        assert resp.status == 200
    assert all(state.prefix.size(e) == 0 for e in state.registry)
