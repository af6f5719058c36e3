"""A tenant is charged the engine's own usage, never counts the client wrote into the answer.

Reviewer findings: usage was found by regex anywhere in the answer's last 2 KB, ``prompt_tokens``
first, so a Messages tool call's input (which the prompt steers) or a Responses answer's
echoed JSON schema holding ``"prompt_tokens": 0`` zeroed the charge; and a long echoed field
after the usage (Responses' ``user``) pushed it out of the 2 KB. Now a body's top-level
``usage`` is read, a stream's last ``usage`` object, with the API's names
(``gateway/proxy/usage.py``). Real gateway, real replicas over sockets.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from gateway.proxy.usage import answer_usage, stream_usage
from gateway.request.types import ApiKind, Usage
from tests.support.edge_cases import TENANT_KEY, keys_yaml

AUTH = {"authorization": f"Bearer {TENANT_KEY}"}
SPOOF = {"prompt_tokens": 0, "completion_tokens": 0, "input_tokens": 0, "output_tokens": 0}


def _messages_answer(tool_input: dict[str, Any]) -> dict[str, Any]:
    """vLLM's Messages answer: content (a tool call the model wrote) first, usage last."""
    return {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "tiny",
        "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": tool_input}],
        "stop_reason": "tool_use",
        "usage": {"input_tokens": 400, "output_tokens": 500},
    }


def _responses_answer(schema: dict[str, Any]) -> dict[str, Any]:
    """vLLM's Responses answer in its field order: the request's ``text.format`` echoed before
    usage, its ``user`` after it (here long enough to push usage out of a 2 KB tail)."""
    return {
        "id": "resp_1",
        "object": "response",
        "model": "tiny",
        "output": [],
        "status": "completed",
        "text": {"format": {"type": "json_schema", "name": "r", "schema": schema}},
        "usage": {"input_tokens": 400, "output_tokens": 500, "total_tokens": 900},
        "user": "u" * 2100 if "usage" in schema else "u1",
    }


@pytest.mark.parametrize(
    ("path", "answer", "request_body"),
    [
        (
            "/v1/messages",
            _messages_answer,
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 500},
        ),
        ("/v1/responses", _responses_answer, {"input": "hi", "max_output_tokens": 500, "store": False}),
    ],
)
async def test_counts_the_client_wrote_into_the_answer_are_not_usage(
    start_upstream, start_gateway, http, tmp_path, path, answer, request_body
) -> None:
    """Two tenants' worth of the same request: one with a harmless object in the answer, one with
    usage-named counts (and a ``usage`` object of its own) there. Both are charged the engine's 900."""
    remaining = []
    for planted in ({"a": "b"}, {**SPOOF, "usage": dict(SPOOF)}):
        upstream = await start_upstream()
        upstream.mode, upstream.status = "status", 200
        upstream.body, upstream.content_type = json.dumps(answer(planted)).encode(), "application/json"
        keys = keys_yaml(tmp_path / f"keys{len(remaining)}.yaml", tokens_per_minute=1000)
        gw = await start_gateway([upstream.url], auth={"enabled": True, "keys_file": keys})
        body = {"model": "tiny", **request_body}
        async with http.post(gw.url + path, json=body, headers=AUTH) as resp:
            assert resp.status == 200, await resp.text()
        await asyncio.sleep(0.3)  # settled off the response path (memory backend: at once)
        cheap = {**body, "max_tokens": 1} if "max_tokens" in body else {**body, "max_output_tokens": 1}
        async with http.post(gw.url + path, json=cheap, headers=AUTH) as resp:
            assert resp.status == 200, await resp.text()
            remaining.append(int(resp.headers["x-ratelimit-remaining-tokens"]))
    assert remaining[1] == pytest.approx(remaining[0], abs=5)  # old: ~102 vs ~997
    assert remaining[0] < 200  # the engine's 900 were charged


def _answer(usage: dict[str, Any], before: dict[str, Any] | None = None) -> bytes:
    return json.dumps({**(before or {}), "usage": usage}).encode()


def test_each_api_reads_its_own_names() -> None:
    chat = {"prompt_tokens": 10, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 8}}
    assert answer_usage(_answer(chat), ApiKind.CHAT) == Usage(10, 3, 8)
    responses = {"input_tokens": 10, "output_tokens": 3, "input_tokens_details": {"cached_tokens": 4}}
    assert answer_usage(_answer(responses), ApiKind.RESPONSES) == Usage(10, 3, 4)
    assert answer_usage(_answer(responses), ApiKind.CHAT) is None  # not chat's names
    # Anthropic's input_tokens leave the cache out: the prompt is input + read + written.
    messages = {
        "input_tokens": 2,
        "output_tokens": 3,
        "cache_read_input_tokens": 8,
        "cache_creation_input_tokens": 1,
    }
    assert answer_usage(_answer(messages), ApiKind.MESSAGES) == Usage(11, 3, 8)
    assert answer_usage(b'{"input_tokens": 42}', ApiKind.COUNT_TOKENS) == Usage(42, 0)


def test_a_body_s_usage_is_its_top_level_one() -> None:
    planted = {"content": {"usage": {"prompt_tokens": 0, "completion_tokens": 0}}}
    real = {"prompt_tokens": 7, "completion_tokens": 1}
    assert answer_usage(_answer(real, planted), ApiKind.CHAT) == Usage(7, 1)
    # The engine reported none: a client-steered object inside the content is not taken for it.
    assert answer_usage(json.dumps(planted).encode(), ApiKind.CHAT) is None
    # Fields after usage (an echoed user, prompt_token_ids) do not hide it, however long.
    after = json.dumps({"usage": real, "user": "u" * 5000, "prompt_token_ids": list(range(3000))}).encode()
    assert answer_usage(after, ApiKind.CHAT) == Usage(7, 1)
    # A big body (an embeddings batch): its tail first, the whole body when the tail has none.
    big = json.dumps({"data": [{"embedding": [0.5] * 30_000}], "usage": real}).encode()
    assert answer_usage(big, ApiKind.EMBEDDINGS) == Usage(7, 1)
    big_hidden = json.dumps({"data": [0.5] * 30_000, "usage": real, "user": "u" * 5000}).encode()
    assert answer_usage(big_hidden, ApiKind.EMBEDDINGS) == Usage(7, 1)


def test_a_stream_s_usage_is_its_last_usage_object() -> None:
    stream = b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}\n\ndata: [DONE]\n\n'
    assert stream_usage(stream, ApiKind.CHAT) == Usage(5, 2)
    # A key ending in \"usage" is no "usage" key (its first quote is escaped): a later
    # client-steered object holding one is skipped, the engine's usage found before it.
    fooled = stream[:-14] + b'data: {"delta": {"say \\"usage": {"prompt_tokens": 0}}}\n\n'
    assert json.loads(fooled.split(b"\n\n")[1][6:]) == {"delta": {'say "usage': {"prompt_tokens": 0}}}
    assert stream_usage(fooled, ApiKind.CHAT) == Usage(5, 2)


def test_sglang_messages_input_tokens_hold_the_cache_already() -> None:
    usage = {"input_tokens": 4000, "output_tokens": 10, "cache_read_input_tokens": 3900}
    assert answer_usage(_answer(usage), ApiKind.MESSAGES, cache_in_input=True) == Usage(4000, 10, 3900)
    assert answer_usage(_answer(usage), ApiKind.MESSAGES) == Usage(7900, 10, 3900)  # vLLM, Anthropic


@pytest.mark.parametrize(
    "value", [True, -1, 10**15, 10**400, 1.5, "12", None, [3]], ids=lambda v: repr(v)[:12]
)
def test_a_count_of_the_wrong_type_or_size_is_none(value: object) -> None:
    for read in (answer_usage, stream_usage):
        payload = b'{"usage": {"prompt_tokens": ' + json.dumps(value).encode() + b', "completion_tokens": 1}}'
        assert read(payload, ApiKind.CHAT) is None
        payload = b'{"usage": {"prompt_tokens": 3, "completion_tokens": ' + json.dumps(value).encode() + b"}}"
        assert read(payload, ApiKind.CHAT) == Usage(3, 0)


def test_a_cut_broken_or_hostile_answer_is_no_usage_and_never_raises() -> None:
    deep = b'{"usage": {"x": ' + b"[" * 5000 + b"]" * 5000 + b"}}"
    deep_elsewhere = b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b', "usage": {"prompt_tokens": 1}}'
    for payload in (
        b'"usage": {"prompt_tokens": 3',
        b'"usage": [1]',
        b'"usage": {"prompt_tokens": \xff}',
        b"\xff" * 9,
        b"",
        deep,
        b'{"usage": {"x": ' + b"[" * 1000,
    ):
        for read in (answer_usage, stream_usage):
            for api in ApiKind:
                assert read(payload, api) is None, (payload[:40], api)
    for api in ApiKind:  # a whole body that nests deeply elsewhere: no usage, and no exception
        answer_usage(deep_elsewhere, api)
