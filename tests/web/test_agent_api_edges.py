"""What held up under adversarial use (kept as regression tests: all pass on the current code)."""

from __future__ import annotations

import openai
import pytest

SIM = "sim-llama"


async def test_chain_through_two_gateways_and_delete_on_one(start_sim, start_gateway, openai_client):
    sims = [await start_sim(), await start_sim()]
    gw1 = await start_gateway([s.url for s in sims], policy="round-robin")
    gw2 = await start_gateway([s.url for s in sims], policy="round-robin")
    c1, c2 = openai_client(gw1), openai_client(gw2)
    first = await c1.responses.create(model=SIM, input="one", max_output_tokens=2)
    second = await c2.responses.create(
        model=SIM, input="two", max_output_tokens=2, previous_response_id=first.id
    )
    third = await c1.responses.create(
        model=SIM, input="3", max_output_tokens=2, previous_response_id=second.id
    )
    assert (await c2.responses.retrieve(third.id)).id == third.id
    await c1.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        await c2.responses.retrieve(first.id)  # gw2's record is stale: the replica's own 404
    with pytest.raises(openai.NotFoundError):
        await c1.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        await c1.responses.delete(first.id)
    with pytest.raises(openai.BadRequestError):
        await c1.responses.cancel(third.id)  # finished: the replica's 400 passes through
    items = await c2.responses.input_items.list(second.id)
    assert items.data


async def test_conflicting_session_headers_and_chain(start_sim, start_gateway, openai_client):
    sims = [await start_sim(), await start_sim()]
    gw = await start_gateway([s.url for s in sims], policy="round-robin")
    client = openai_client(gw)
    headers = {
        "x-claude-code-session-id": "a",
        "session_id": "b",
        "session-id": "c",
        "x-session-affinity": "d",
    }
    first = await client.responses.with_raw_response.create(
        model=SIM, input="x", max_output_tokens=2, extra_headers=headers, user="u", prompt_cache_key="k"
    )
    owner = first.headers["x-gateway-endpoint"]
    for _ in range(3):
        nxt = await client.responses.with_raw_response.create(
            model=SIM,
            input="y",
            max_output_tokens=2,
            previous_response_id=first.parse().id,
            extra_headers={"x-claude-code-session-id": "zzz"},
        )
        assert nxt.headers["x-gateway-endpoint"] == owner
