"""A weighted alias split and Responses chains: a ``previous_response_id`` continues on the target
and the replica that stored it, without any session header (the official ``openai`` SDK, real
simulators that store responses in-process, a real gateway)."""

from __future__ import annotations

import asyncio

import openai
import pytest

SPLIT = {"chat": [{"model": "v1", "weight": 50}, {"model": "v2", "weight": 50}]}


@pytest.fixture
async def fleet(start_sim, start_gateway):
    sims = [await start_sim(model=m) for m in ("v1", "v1", "v2", "v2")]
    # round-robin: any step routed by policy instead of by its chain would change replica
    gw = await start_gateway([s.url for s in sims], policy="round-robin", models=SPLIT)
    return gw, sims


async def _chain(client, steps: int, stream_last: bool = False) -> list[tuple[str, str]]:
    """(target, replica) of each step of one chain."""
    previous, seen = None, []
    for step in range(steps):
        extra = {"previous_response_id": previous} if previous else {}
        if stream_last and step == steps - 1:
            raw = await client.responses.with_raw_response.create(
                model="chat", input=f"step {step}", max_output_tokens=3, stream=True, **extra
            )
            events = [e async for e in raw.parse()]
            assert events[-1].type == "response.completed"
            previous = events[0].response.id
        else:
            raw = await client.responses.with_raw_response.create(
                model="chat", input=f"step {step}", max_output_tokens=3, **extra
            )
            response = raw.parse()
            assert response.output_text
            previous = response.id
        seen.append((raw.headers["x-gateway-model"], raw.headers["x-gateway-endpoint"]))
    return seen


async def test_every_chain_keeps_its_first_target_and_replica(fleet, openai_client):
    gw, sims = fleet
    client = openai_client(gw)
    chains = await asyncio.gather(*(_chain(client, 5, stream_last=i % 3 == 0) for i in range(12)))
    for chain in chains:
        assert len(set(chain)) == 1, chain  # one target, one replica, all five steps
    targets = {chain[0][0] for chain in chains}
    assert targets == {"v1", "v2"}, "the split itself still sends new conversations to both"
    by_name = {s.url.split("://")[1]: s.config.model for s in sims}
    assert all(by_name[replica] == target for chain in chains for target, replica in chain)


async def test_a_continuation_naming_the_target_itself_stays_too(fleet, openai_client):
    gw, _ = fleet
    client = openai_client(gw)
    raw = await client.responses.with_raw_response.create(model="chat", input="hi", max_output_tokens=2)
    target, replica = raw.headers["x-gateway-model"], raw.headers["x-gateway-endpoint"]
    again = await client.responses.with_raw_response.create(
        model=target, input="more", max_output_tokens=2, previous_response_id=raw.parse().id
    )
    assert again.headers["x-gateway-endpoint"] == replica


async def test_an_unknown_previous_response_under_an_alias_is_a_clear_404(fleet, openai_client):
    gw, sims = fleet
    client = openai_client(gw)
    with pytest.raises(openai.NotFoundError) as caught:
        await client.responses.create(model="chat", input="x", previous_response_id="resp_nowhere")
    assert caught.value.code == "response_not_found"
    assert all(not s.engine.finished.get("length") for s in sims)  # no replica was asked to generate


async def test_a_refused_chain_under_an_alias_refunds_its_tokens(start_sim, start_gateway, http, tmp_path):
    """The chain's replica is looked up after the tenant's tokens are booked: its 404 must give
    them back (the lookup ran outside the settling ``try``, so they stayed booked)."""
    import hashlib

    sim = await start_sim(model="v1")
    keys = tmp_path / "keys.yaml"
    digest = hashlib.sha256(b"sk-t").hexdigest()
    keys.write_text(
        f"tenants:\n  t: {{tokens_per_minute: 5000}}\nkeys:\n  - sha256: {digest}\n    tenant: t\n"
    )
    gw = await start_gateway([sim.url], models={"chat": "v1"}, auth={"enabled": True, "keys_file": str(keys)})
    headers = {"authorization": "Bearer sk-t"}
    body = {"model": "chat", "input": "x", "max_output_tokens": 1000, "previous_response_id": "resp_nowhere"}
    for _ in range(8):  # each books ~1000 tokens of the 5000; refunded, none runs the budget down
        async with http.post(gw.url + "/v1/responses", json=body, headers=headers) as resp:
            assert resp.status == 404, await resp.text()
        await asyncio.sleep(0.05)  # the refund is settled just after the answer
    async with http.post(gw.url + "/v1/responses", json={**body, "previous_response_id": None},
                         headers=headers) as resp:  # fmt: skip
        assert resp.status == 200, await resp.text()
