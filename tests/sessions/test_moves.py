"""A session leaves its pinned replica when the replica dies or saturates, and re-pins there.

``llm_gateway_session_moves_total{reason}`` says why: ``gone`` (no longer a candidate),
``saturated`` (the saturation detector says it has no headroom), ``scored`` (the other
scorers outweighed affinity on a healthy replica).
"""

from __future__ import annotations

import asyncio
import itertools

from tests.sessions.conftest import FAST, session_gateway_kw, started_gateway, turn
from tests.support.harness import gateway_metrics, metric_value, wait_until
from tests.support.upstreams import vllm_metrics


async def _moves(http, gw, reason: str) -> float:
    return (
        metric_value(await gateway_metrics(http, gw), "llm_gateway_session_moves_total", reason=reason) or 0
    )


async def _healthy(http, gw, name: str) -> bool:
    text = await gateway_metrics(http, gw)
    return metric_value(text, "llm_gateway_endpoint_healthy", endpoint=name) == 1


async def test_session_moves_when_its_replica_is_gone_and_is_repinned(
    start_sims, start_gateway, openai_client, http
) -> None:
    sims = await start_sims(3)
    gw = await started_gateway(start_gateway, [s.url for s in sims])
    client = openai_client(gw)
    sid = {"x-session-id": "doomed"}

    pinned, _ = await turn(client, headers=sid)
    assert (await turn(client, headers=sid))[0] == pinned
    victim = next(s for s in sims if s.name == pinned)
    await victim.stop()
    await wait_until(
        lambda: _not(_healthy(http, gw, pinned)), 3.0, "the stopped replica to be marked unhealthy"
    )

    moved, _ = await turn(client, headers=sid)
    assert moved != pinned
    # Re-pinned: the following turns stay on the new replica.
    for _ in range(4):
        assert (await turn(client, headers=sid))[0] == moved
    assert await _moves(http, gw, "gone") == 1
    assert await _moves(http, gw, "saturated") == 0
    assert await _moves(http, gw, "scored") == 0
    text = await gateway_metrics(http, gw)
    assert metric_value(text, "llm_gateway_session_hits_total") == 1 + 4


async def test_session_moves_as_gone_when_its_replica_dies_before_health_notices(
    start_sims, start_gateway, openai_client, http
) -> None:
    sims = await start_sims(3)
    # Slow health checks: the gateway still believes the dead replica is healthy.
    gw = await start_gateway(
        [s.url for s in sims],
        policy="session-aware",
        health={"interval_s": 30, "timeout_s": 0.3, "unhealthy_threshold": 1},
        scrape=FAST["scrape"],
    )
    client = openai_client(gw)
    sid = {"x-session-id": "sudden-death"}

    pinned, _ = await turn(client, headers=sid)
    victim = next(s for s in sims if s.name == pinned)
    await victim.stop()

    moved, _ = await turn(client, headers=sid)  # connect refused → retried elsewhere, still 200
    assert moved != pinned
    assert (await turn(client, headers=sid))[0] == moved  # re-pinned on the replica that served it
    text = await gateway_metrics(http, gw)
    assert metric_value(text, "llm_gateway_session_hits_total") == 1  # only the last turn
    assert await _moves(http, gw, "gone") == 1
    assert await _moves(http, gw, "scored") == 0


async def test_session_moves_when_its_replica_saturates_and_is_repinned(
    start_upstream, start_gateway, openai_client, http
) -> None:
    """Two tiny upstreams; the pinned one starts reporting a deep engine queue (waiting=10 ≥ 5)."""
    ups = [await start_upstream(models=("tiny",)) for _ in range(2)]
    gw = await started_gateway(start_gateway, [u.url for u in ups])
    client = openai_client(gw)
    sid = {"x-session-id": "busy"}

    pinned, _ = await turn(client, headers=sid, model="tiny")
    assert (await turn(client, headers=sid, model="tiny"))[0] == pinned
    hot = next(u for u in ups if u.name == pinned)
    hot.metrics_text = vllm_metrics(waiting=10, running=8, model="tiny")

    async def saturated() -> bool:
        text = await gateway_metrics(http, gw)
        return metric_value(text, "llm_gateway_endpoint_saturated", endpoint=pinned) == 1

    await wait_until(saturated, 3.0, "the pinned replica to be seen saturated")

    # Affinity no longer scores the saturated replica; the prefix scorers tie, so the move
    # happens at a random turn — bounded: P(no move in 30 turns) = 2^-30.
    seen = []
    for _ in range(30):
        endpoint, _ = await turn(client, headers=sid, model="tiny")
        seen.append(endpoint)
        if endpoint != pinned:
            break
    assert seen[-1] != pinned, "the session never left its saturated replica"
    moved = seen[-1]
    for _ in range(4):  # re-pinned on the replica with headroom
        assert (await turn(client, headers=sid, model="tiny"))[0] == moved
    assert await _moves(http, gw, "saturated") == 1
    assert await _moves(http, gw, "gone") == 0
    assert await _moves(http, gw, "scored") == 0

    # The old replica recovering does not pull the session back: it is pinned to the new one.
    hot.metrics_text = vllm_metrics(model="tiny")

    async def recovered() -> bool:
        text = await gateway_metrics(http, gw)
        return metric_value(text, "llm_gateway_endpoint_saturated", endpoint=pinned) == 0

    await wait_until(recovered, 3.0, "the old replica to recover")
    for _ in range(4):
        assert (await turn(client, headers=sid, model="tiny"))[0] == moved


async def _not(check) -> bool:
    return not await check


async def _conversations(client, sessions: int, turns: int) -> dict[str, list[str]]:
    """``sessions`` conversations of growing histories, turn by turn; where each turn was served."""
    served: dict[str, list[str]] = {}
    for number in range(turns):
        for s in range(sessions):
            text = f"session {s} " * 100
            history = [{"role": "user", "content": f"{text}turn {t}"} for t in range(number + 1)]
            headers = {"x-session-id": f"s{s}"}
            endpoint, _ = await turn(client, headers=headers, model="tiny", messages=history)
            served.setdefault(f"s{s}", []).append(endpoint)
    return served


async def _scraped(http, gw, ups, value: int) -> None:
    async def seen() -> bool:
        text = await gateway_metrics(http, gw)
        states = [metric_value(text, "llm_gateway_endpoint_saturated", endpoint=u.name) for u in ups]
        return states == [value] * len(ups)

    await wait_until(seen, 3.0, f"saturation == {value}")


async def test_a_session_leaves_a_saturated_replica_only_for_one_with_headroom(
    start_upstream, start_gateway, openai_client, http
) -> None:
    """Sessions pinned to saturated replicas used to move to another saturated one, and back on the
    next turn (ABAB…: a cold cache every turn). A move now lands where there is room and stays."""
    full = [await start_upstream(metrics_text=vllm_metrics(kv=0.95)) for _ in range(2)]
    roomy = await start_upstream(metrics_text=vllm_metrics(kv=0.1))
    gw = await started_gateway(start_gateway, [u.url for u in (*full, roomy)])
    await _scraped(http, gw, full, 1)
    await _scraped(http, gw, [roomy], 0)
    served = await _conversations(openai_client(gw), sessions=8, turns=5)
    for session, endpoints in served.items():
        for before, after in itertools.pairwise(endpoints):
            assert before == after or after == roomy.name, (session, endpoints)


async def test_sessions_stay_on_their_saturated_replicas_when_none_has_headroom(
    start_upstream, start_gateway, openai_client, http
) -> None:
    full = [await start_upstream(metrics_text=vllm_metrics(kv=0.95)) for _ in range(2)]
    # Admission off: a fully saturated pool would queue these turns; routing is what is tested.
    kw = session_gateway_kw()
    gw = await start_gateway([u.url for u in full], admission={"enabled": False}, **kw)
    await _scraped(http, gw, full, 1)
    served = await _conversations(openai_client(gw), sessions=6, turns=4)
    for session, endpoints in served.items():
        assert len(set(endpoints)) == 1, (session, endpoints)  # moving would only trade the warm cache
    assert await _moves(http, gw, "saturated") == 0


async def test_a_session_whose_replica_is_at_its_concurrency_cap_moves_as_saturated_not_gone(
    stack, start_upstream, start_gateway, http
) -> None:
    ups = [await start_upstream() for _ in range(2)]
    gw = await start_gateway(
        [u.url for u in ups], admission={"endpoint_max_concurrency": 1}, **session_gateway_kw()
    )
    session = {"x-session-id": "capped"}

    async def send(stream: bool) -> str:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
        async with http.post(gw.url + "/v1/chat/completions", json=body, headers=session) as resp:
            await resp.read()
            return resp.headers["x-gateway-endpoint"]

    pinned = await send(False)
    busy = next(u for u in ups if u.name == pinned)
    busy.mode = "gated"  # its next stream holds its one slot
    stack.callback(busy.gate.set)
    held = asyncio.create_task(send(True))
    await asyncio.wait_for(busy.first_chunk_sent.wait(), 3.0)
    moved = await send(False)
    assert moved != pinned
    assert await _moves(http, gw, "saturated") == 1
    assert await _moves(http, gw, "gone") == 0
    busy.gate.set()
    assert await held == pinned
