"""The OpenAI Responses API through the gateway with the official ``openai`` SDK, against two
simulators that store responses in-process: every continuation reaches the replica that
stored the response it continues."""

from __future__ import annotations

import openai
import pytest

from tests.support.harness import wait_until

SIM = "sim-llama"


@pytest.fixture
async def fleet(start_sim, start_gateway):
    sims = [await start_sim(), await start_sim()]
    gw = await start_gateway([s.url for s in sims], policy="round-robin")
    return gw, sims


async def test_create_json_and_retrieve(fleet, openai_client):
    gw, _ = fleet
    client = openai_client(gw)
    raw = await client.responses.with_raw_response.create(model=SIM, input="Say hello", max_output_tokens=5)
    response = raw.parse()
    assert response.id.startswith("resp_")
    assert response.output_text
    assert response.usage is not None and response.usage.output_tokens == 5
    endpoint = raw.headers["x-gateway-endpoint"]
    for _ in range(4):  # round-robin would alternate: retrieval must follow the stored replica
        got = await client.responses.with_raw_response.retrieve(response.id)
        assert got.headers["x-gateway-endpoint"] == endpoint
        assert got.parse().id == response.id
    items = await client.responses.input_items.list(response.id)
    assert items.data


async def test_stream_passes_typed_events_through(fleet, openai_client):
    gw, _ = fleet
    client = openai_client(gw)
    stream = await client.responses.create(
        model=SIM, input="Tell me a story", max_output_tokens=6, stream=True
    )
    events = [event async for event in stream]
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created"
    assert kinds[-1] == "response.completed"
    assert kinds.count("response.output_text.delta") == 6
    assert [e.sequence_number for e in events] == list(range(len(events)))
    response_id = events[0].response.id
    retrieved = await client.responses.retrieve(response_id)  # recorded from response.created
    assert retrieved.status in ("completed", "incomplete")


async def test_five_step_chain_stays_on_the_storing_replica(fleet, openai_client):
    gw, sims = fleet
    client = openai_client(gw)
    previous = None
    replicas = []
    for turn in range(5):
        stream = turn % 2 == 1
        kwargs = {"previous_response_id": previous} if previous else {}
        if stream:
            raw = await client.responses.with_raw_response.create(
                model=SIM, input=f"turn {turn}", max_output_tokens=3, stream=True, **kwargs
            )
            events = [e async for e in raw.parse()]
            previous = events[0].response.id
        else:
            raw = await client.responses.with_raw_response.create(
                model=SIM, input=f"turn {turn}", max_output_tokens=3, **kwargs
            )
            previous = raw.parse().id
        replicas.append(raw.headers["x-gateway-endpoint"])
    assert len(set(replicas)) == 1, replicas  # round-robin policy, yet every step on one replica
    other = next(s for s in sims if not s.url.endswith(replicas[0]))
    assert sum(other.engine.state()["finished"].values()) == 0  # the other replica saw none of it
    # The prefix of each turn was cached on the replica: the last turn read from its cache.
    last = await client.responses.retrieve(previous)
    assert last.usage is not None and last.usage.input_tokens_details.cached_tokens > 0


async def test_unknown_previous_response_is_a_404(fleet, openai_client):
    gw, _ = fleet
    client = openai_client(gw)
    with pytest.raises(openai.NotFoundError) as caught:
        await client.responses.create(model=SIM, input="hi", previous_response_id="resp_nope")
    assert caught.value.body["code"] == "response_not_found"


async def test_replica_gone_is_a_clear_409(start_sim, start_gateway, openai_client, stack):
    sims = [await start_sim(), await start_sim()]
    gw = await start_gateway([s.url for s in sims], policy="round-robin")
    client = openai_client(gw)
    raw = await client.responses.with_raw_response.create(model=SIM, input="hi", max_output_tokens=2)
    first = raw.parse()
    owner = raw.headers["x-gateway-endpoint"]
    endpoint = next(e for e in gw.state.registry if e.name == owner)
    endpoint.healthy = False
    gw.state.registry.rebuild()
    with pytest.raises(openai.ConflictError) as caught:
        await client.responses.create(model=SIM, input="more", previous_response_id=first.id)
    body = caught.value.body
    assert body["code"] == "response_replica_unavailable"
    assert "replica is unavailable" in body["message"] and owner in body["message"]
    with pytest.raises(openai.ConflictError):
        await client.responses.retrieve(first.id)


async def test_a_chain_continued_with_a_model_its_replica_lacks_is_a_409_not_a_retryable_503(
    start_sim, start_gateway, openai_client
):
    """The chain can only continue on the replica that stores it; if that replica does not serve
    the model asked for, no retry helps — it used to be a 503 with Retry-After (retried by the SDK
    and, with Retry-After honoured, for ever), saying no endpoint serves a model one does."""
    a, b = await start_sim(model="model-a"), await start_sim(model="model-b")
    gw = await start_gateway([a.url, b.url], policy="round-robin")
    client = openai_client(gw)
    first = await client.responses.create(model="model-a", input="hi", max_output_tokens=2)
    with pytest.raises(openai.ConflictError) as caught:
        await client.responses.create(model="model-b", input="more", previous_response_id=first.id)
    assert caught.value.response.headers.get("retry-after") is None
    body = caught.value.body
    assert body["code"] == "response_replica_lacks_model"
    assert "model-b" in body["message"] and "model-a" in body["message"]
    again = await client.responses.create(model="model-a", input="more", previous_response_id=first.id)
    assert again.output_text  # the chain itself is fine


async def test_delete_then_retrieve_is_404(fleet, openai_client):
    gw, _ = fleet
    client = openai_client(gw)
    response = await client.responses.create(model=SIM, input="hi", max_output_tokens=2)
    await client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(response.id)


async def test_unrecorded_response_is_found_by_asking_the_replicas(fleet, openai_client):
    """Another gateway worker (memory store) or a restart: the replicas are asked once."""
    gw, _ = fleet
    client = openai_client(gw)
    raw = await client.responses.with_raw_response.create(model=SIM, input="hi", max_output_tokens=2)
    response = raw.parse()
    gw.state.sessions.responses.forget(response.id)
    follow = await client.responses.with_raw_response.create(
        model=SIM, input="again", max_output_tokens=2, previous_response_id=response.id
    )
    assert follow.headers["x-gateway-endpoint"] == raw.headers["x-gateway-endpoint"]


async def test_client_disconnect_mid_stream_aborts_upstream(start_sim, start_gateway, http):
    sim = await start_sim(time_scale=1.0)
    gw = await start_gateway([sim.url])
    body = {"model": SIM, "input": "long answer please", "max_output_tokens": 2000, "stream": True}
    resp = await http.post(gw.url + "/v1/responses", json=body)
    assert resp.status == 200
    await resp.content.readuntil(b"response.output_text.delta")
    assert sim.engine.state()["running"] == 1
    resp.close()

    async def aborted() -> bool:
        state = sim.engine.state()
        return state["running"] == 0 and state["waiting"] == 0

    await wait_until(aborted, 3.0, "the simulator to abort the request")
