"""The signed replica token (``x-session-token``): clients without a session id can stick with it.

A token is the replica's name plus an HMAC; a tampered or foreign token must be ignored
(the request is still served normally, it just pins nothing), never an error.
"""

from __future__ import annotations

import base64

import pytest

from tests.sessions.conftest import session_gateway_kw, started_gateway, turn
from tests.support.harness import gateway_metrics, metric_value


def _b64(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


async def _hits(http, gw) -> float:
    return metric_value(await gateway_metrics(http, gw), "llm_gateway_session_hits_total") or 0


async def _moves(http, gw) -> float:
    return metric_value(await gateway_metrics(http, gw), "llm_gateway_session_moves_total") or 0


async def test_response_carries_a_token_and_replaying_it_sticks(
    start_sims, start_gateway, openai_client, http
) -> None:
    sims = await start_sims(3)
    gw = await started_gateway(start_gateway, [s.url for s in sims])
    client = openai_client(gw)

    first, headers = await turn(client)  # no session id at all
    token = headers.get("x-session-token")
    assert token, "a session-aware gateway returns a replica token"
    assert token.split(".", 1)[0] == _b64(first)

    for _ in range(8):  # unrelated prompts, only the token can keep them together
        endpoint, headers = await turn(client, headers={"x-session-token": token})
        assert endpoint == first
        assert headers.get("x-session-token") == token  # same replica, same token
    assert await _hits(http, gw) == 8
    # A token pins nothing in the store: it is the client's to carry.
    assert (metric_value(await gateway_metrics(http, gw), "llm_gateway_sessions_active") or 0) == 0


async def test_streaming_response_carries_the_token(start_sims, start_gateway, openai_client) -> None:
    sims = await start_sims(2)
    gw = await started_gateway(start_gateway, [s.url for s in sims])
    client = openai_client(gw)
    async with client.chat.completions.with_streaming_response.create(
        model="sim-llama", messages=[{"role": "user", "content": "stream me"}], max_tokens=4, stream=True
    ) as response:
        token = response.headers.get("x-session-token")
        endpoint = response.headers.get("x-gateway-endpoint")
        chunks = [line async for line in response.iter_lines() if line.startswith("data:")]
    assert chunks and chunks[-1] == "data: [DONE]"
    assert token and token.split(".", 1)[0] == _b64(endpoint)


def _forgeries(valid: str, target: str) -> list[str]:
    encoded, mac = valid.split(".", 1)
    flipped = ("0" if mac[0] != "0" else "1") + mac[1:]
    return [
        _b64(target) + "." + mac,  # another replica's name under a stolen MAC
        encoded + "." + flipped,  # the right replica, tampered MAC
        _b64(target) + "." + "0" * 32,  # a made-up MAC
        _b64(target),  # no MAC at all
        "." + mac,  # no payload
        "not a token at all",
        "%%%.@@@",  # not base64
        _b64(target) + "." + mac + "x" * 600,  # oversized
    ]


async def test_forged_or_tampered_tokens_are_ignored_not_errors(
    start_sims, start_gateway, openai_client, http
) -> None:
    sims = await start_sims(3)
    gw = await started_gateway(start_gateway, [s.url for s in sims])
    client = openai_client(gw)
    first, headers = await turn(client)
    valid = headers["x-session-token"]
    target = next(s.name for s in sims if s.name != first)

    served = []
    for forged in _forgeries(valid, target):
        for _ in range(3):
            endpoint, _ = await turn(client, headers={"x-session-token": forged})  # 200, not 4xx/5xx
            served.append(endpoint)
    # Not ASCII (the SDK refuses to send it, so raw HTTP): still served, still no pin.
    body = {"model": "sim-llama", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    async with http.post(
        gw.url + "/v1/chat/completions", json=body, headers={"x-session-token": "é." + valid.split(".")[1]}
    ) as resp:
        assert resp.status == 200, await resp.text()
    assert await _hits(http, gw) == 0, "a forged token must not count as (or act as) a pin"
    assert await _moves(http, gw) == 0
    assert len(set(served)) > 1, "forged tokens must not steer every request to one replica"

    # The genuine token still works afterwards.
    assert (await turn(client, headers={"x-session-token": valid}))[0] == first
    assert await _hits(http, gw) == 1


async def test_session_id_takes_precedence_over_a_token(
    start_sims, start_gateway, openai_client, http
) -> None:
    sims = await start_sims(3)
    gw = await started_gateway(start_gateway, [s.url for s in sims])
    client = openai_client(gw)
    pinned, _ = await turn(client, headers={"x-session-id": "real"})
    other = next(s.name for s in sims if s.name != pinned)
    # A genuine token for another replica, obtained from a request that landed there.
    token = None
    for _ in range(40):
        endpoint, headers = await turn(client)
        if endpoint == other:
            token = headers["x-session-token"]
            break
    assert token is not None
    for _ in range(3):
        endpoint, _ = await turn(client, headers={"x-session-id": "real", "x-session-token": token})
        assert endpoint == pinned


@pytest.mark.parametrize("shared_secret", [True, False])
async def test_tokens_travel_between_gateways_only_with_a_shared_secret(
    shared_secret: bool, start_sims, start_gateway, openai_client, http
) -> None:
    sims = await start_sims(3)
    urls = [s.url for s in sims]
    secret_a = "s3cret-shared" if shared_secret else "secret-a"
    secret_b = "s3cret-shared" if shared_secret else "secret-b"
    gw_a = await start_gateway(urls, **session_gateway_kw(token_secret=secret_a))
    gw_b = await start_gateway(urls, **session_gateway_kw(token_secret=secret_b))
    first, headers = await turn(openai_client(gw_a))
    token = headers["x-session-token"]
    client_b = openai_client(gw_b)
    served = [(await turn(client_b, headers={"x-session-token": token}))[0] for _ in range(8)]
    if shared_secret:
        assert set(served) == {first}
        assert await _hits(http, gw_b) == 8
    else:
        assert await _hits(http, gw_b) == 0  # a foreign gateway's token is ignored
        assert len(set(served)) > 1


async def test_token_header_can_be_turned_off(start_sims, start_gateway, openai_client, http) -> None:
    sims = await start_sims(2)
    gw = await started_gateway(start_gateway, [s.url for s in sims], token_header=None)
    client = openai_client(gw)
    _, headers = await turn(client)
    assert headers.get("x-session-token") is None
    # Sessions by id still work.
    pinned, headers = await turn(client, headers={"x-session-id": "still-works"})
    assert headers.get("x-session-token") is None
    assert (await turn(client, headers={"x-session-id": "still-works"}))[0] == pinned
