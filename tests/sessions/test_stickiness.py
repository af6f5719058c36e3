"""Sticky sessions end to end with the ``session-aware`` preset: real simulators, real OpenAI SDK.

Every turn sends a prompt that shares no prefix block with any other, so the prefix
scorers see a three-way tie and only session affinity can keep a conversation on one
replica. A control burst without a session id shows the same prompts do spread.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.sessions.conftest import fresh_prompt, started_gateway, turn
from tests.support.harness import gateway_metrics, metric_value, wait_until

SESSIONS = 4
TURNS = 6


def _source(kind: str, session_id: str) -> dict[str, Any]:
    if kind == "header":
        return {"headers": {"x-session-id": session_id}}
    if kind == "user":
        return {"user": session_id}
    return {"extra_body": {"conversation_id": session_id}}


@pytest.mark.parametrize("kind", ["header", "user", "body_field"])
async def test_session_sticks_to_one_replica_across_many_turns(
    kind: str, start_sims, start_gateway, openai_client, http
) -> None:
    sims = await start_sims(3)
    sessions_cfg: dict[str, Any] = {"body_fields": ["conversation_id"]} if kind == "body_field" else {}
    gw = await started_gateway(start_gateway, [s.url for s in sims], **sessions_cfg)
    client = openai_client(gw)

    served: dict[str, list[str]] = {f"{kind}-conv-{i}": [] for i in range(SESSIONS)}
    for _ in range(TURNS):  # interleaved, one at a time: no in-flight load biases the scores
        for session_id, seen in served.items():
            endpoint, _ = await turn(client, **_source(kind, session_id))
            seen.append(endpoint)
    for session_id, seen in served.items():
        assert len(set(seen)) == 1, f"{session_id} wandered across replicas: {seen}"

    text = await gateway_metrics(http, gw)
    assert metric_value(text, "llm_gateway_session_hits_total") == SESSIONS * (TURNS - 1)
    assert (metric_value(text, "llm_gateway_session_moves_total") or 0) == 0
    assert metric_value(text, "llm_gateway_sessions_active") == SESSIONS

    # Control: the same kind of prompts without any session source do spread over the fleet.
    spread = {(await turn(client))[0] for _ in range(12)}
    assert len(spread) > 1, "without a session the tie must be broken at random"
    text = await gateway_metrics(http, gw)
    assert metric_value(text, "llm_gateway_session_hits_total") == SESSIONS * (TURNS - 1)


async def test_header_wins_over_body_fields_and_fields_are_tried_in_order(
    start_sims, start_gateway, openai_client, http
) -> None:
    sims = await start_sims(3)
    gw = await started_gateway(start_gateway, [s.url for s in sims], body_fields=["conversation_id", "user"])
    client = openai_client(gw)

    # The header names the session; the body fields change every turn and must not matter.
    first, _ = await turn(client, headers={"x-session-id": "by-header"}, user="u0")
    for i in range(5):
        endpoint, _ = await turn(
            client,
            headers={"x-session-id": "by-header"},
            user=f"u{i + 1}",
            extra_body={"conversation_id": f"c{i + 1}"},
        )
        assert endpoint == first

    # No header: conversation_id (listed first) names the session, user varies.
    first, _ = await turn(client, user="x0", extra_body={"conversation_id": "conv-A"})
    for i in range(5):
        endpoint, _ = await turn(client, user=f"x{i + 1}", extra_body={"conversation_id": "conv-A"})
        assert endpoint == first

    text = await gateway_metrics(http, gw)
    assert metric_value(text, "llm_gateway_session_hits_total") == 10
    # by-header and conv-A only: the varying user/conversation values never became sessions.
    assert metric_value(text, "llm_gateway_sessions_active") == 2


async def test_non_session_aware_policy_pins_nothing(start_sims, start_gateway, openai_client, http) -> None:
    """Sessions are a scorer: under round-robin a session id is ignored, no pins, no token."""
    sims = await start_sims(2)
    gw = await start_gateway([s.url for s in sims], policy="round-robin")
    client = openai_client(gw)
    seen = []
    for _ in range(4):
        endpoint, headers = await turn(client, headers={"x-session-id": "rr"}, messages=fresh_prompt())
        seen.append(endpoint)
        assert headers.get("x-session-token") is None
    assert len(set(seen)) == 2
    text = await gateway_metrics(http, gw)
    assert (metric_value(text, "llm_gateway_session_hits_total") or 0) == 0


async def test_sessions_active_gauge_decays_when_pins_expire(
    start_sims, start_gateway, openai_client, http
) -> None:
    sims = await start_sims(2)
    gw = await started_gateway(start_gateway, [s.url for s in sims], ttl_s=0.3)
    client = openai_client(gw)
    for i in range(3):
        await turn(client, headers={"x-session-id": f"short-{i}"})
    assert metric_value(await gateway_metrics(http, gw), "llm_gateway_sessions_active") == 3

    async def expired() -> bool:
        return metric_value(await gateway_metrics(http, gw), "llm_gateway_sessions_active") == 0

    await wait_until(expired, 1.5, "the active-sessions gauge to drop once every TTL lapsed")
