"""A Messages or Responses stream whose body ends cleanly but without the API's final event
is a broken stream: the client gets the API's error event and the replica a failure.

Regression: such a stream (an engine dying behind a proxy that ends the chunked body
properly) passed as a success, and the SDK returned an answer with no stop reason or usage.
The first check of this (since removed) flagged whole streams too: vLLM's ``data: [DONE]``
after ``message_stop`` in a read of its own, a blank line split after an event passed on in
pieces, marker text inside a string; each of those is pinned here as whole.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.proxy.typed_events import TypedEventBuffer, stream_end
from gateway.request.types import ApiKind
from tests.proxy.test_upstream_close_delimited import _stream_of as close_delimited_stream

_CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n"


def _typed(name: str | None, data: dict) -> bytes:
    line = f"event: {name}\n" if name else ""
    return f"{line}data: {json.dumps(data)}\n\n".encode()


def _chunked(*reads: bytes) -> list[bytes]:
    return [_CHUNKED_HEAD, *(b"%x\r\n%s\r\n" % (len(r), r) for r in reads), b"0\r\n\r\n"]


_MESSAGE = {"id": "msg_1", "type": "message", "role": "assistant", "model": "tiny", "content": []}
_M_OPENING = _typed("message_start", {"type": "message_start", "message": _MESSAGE}) + _typed(
    "content_block_start",
    {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
)
_M_DELTA = _typed(
    "content_block_delta",
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hello"}},
)
_M_STOP = _typed("message_stop", {"type": "message_stop"})
_M_BODY = {"model": "tiny", "max_tokens": 5, "stream": True, "messages": [{"role": "user", "content": "hi"}]}

_R_CREATED = _typed("response.created", {"type": "response.created", "response": {"id": "resp_1"}})
_R_DELTA = _typed("response.output_text.delta", {"type": "response.output_text.delta", "delta": "Hi"})
_R_DONE = _typed("response.completed", {"type": "response.completed", "response": {"id": "resp_1"}})
_R_BODY = {"model": "tiny", "input": "hi", "stream": True}


async def _stream_of(stack, start_gateway, http, parts, path, body) -> tuple[str, int]:
    text, seen = await close_delimited_stream(stack, start_gateway, http, parts, path, body)
    return text, int(seen["errors"] or 0)


def _last_event(text: str) -> str:
    return text.rstrip("\n").rsplit("\n\n", 1)[-1]


@pytest.mark.parametrize("split", [True, False], ids=["relayed", "one-read"])
async def test_a_messages_stream_without_message_stop_ends_with_an_error_event(
    split, stack: contextlib.AsyncExitStack, start_gateway, http
):
    events = [_M_OPENING, _M_DELTA, _M_DELTA]
    reads = events if split else [b"".join(events)]
    text, errors = await _stream_of(stack, start_gateway, http, _chunked(*reads), "/v1/messages", _M_BODY)
    assert text.count("Hello") == 2
    last = _last_event(text)
    assert last.startswith("event: error\n"), text
    error = json.loads(last.split("data: ", 1)[1])
    assert error["type"] == "error" and "before its final event" in error["error"]["message"]
    assert "content_block_delta" in error["error"]["message"]
    assert errors == 1


async def test_vllm_messages_done_after_message_stop_in_its_own_read_is_whole(
    stack: contextlib.AsyncExitStack, start_gateway, http
):
    """vLLM's Messages route ends with ``message_stop`` and then ``data: [DONE]``: whole."""
    reads = [_M_OPENING, _M_DELTA, _M_STOP, b"data: [DONE]\n\n"]
    text, errors = await _stream_of(stack, start_gateway, http, _chunked(*reads), "/v1/messages", _M_BODY)
    assert "event: error" not in text and text.endswith("data: [DONE]\n\n"), text
    assert errors == 0


async def test_a_responses_stream_without_its_final_event_ends_with_an_error_event(
    stack: contextlib.AsyncExitStack, start_gateway, http
):
    # A text that names the final event is not the final event.
    markers = '"type":"response.completed"\n\nevent: response.completed'
    named = _typed(
        "response.output_text.delta",
        {"type": "response.output_text.delta", "delta": markers},
    )
    text, errors = await _stream_of(
        stack, start_gateway, http, _chunked(_R_CREATED, _R_DELTA, named), "/v1/responses", _R_BODY
    )
    last = _last_event(text)
    assert last.startswith("event: error\n"), text
    assert json.loads(last.split("data: ", 1)[1])["type"] == "error"
    assert errors == 1


@pytest.mark.parametrize("named", [True, False], ids=["event-line", "data-type-only"])
async def test_a_responses_stream_ending_on_its_final_event_is_whole(
    named, stack: contextlib.AsyncExitStack, start_gateway, http
):
    done = _R_DONE if named else _typed(None, {"type": "response.completed", "response": {"id": "resp_1"}})
    text, errors = await _stream_of(
        stack, start_gateway, http, _chunked(_R_CREATED, _R_DELTA, done), "/v1/responses", _R_BODY
    )
    assert "event: error" not in text and text.endswith("}\n\n"), text
    assert errors == 0


async def test_a_data_only_delta_last_is_known_not_final(
    stack: contextlib.AsyncExitStack, start_gateway, http
):
    """No ``event:`` lines (a server that sends data alone): a small event is named by its data."""
    delta = _typed(None, {"delta": "Hi", "type": "response.output_text.delta"})
    text, errors = await _stream_of(
        stack, start_gateway, http, _chunked(_R_CREATED, delta, delta), "/v1/responses", _R_BODY
    )
    assert _last_event(text).startswith("event: error\n"), text
    assert errors == 1


@pytest.mark.parametrize("final", [True, False], ids=["then-final", "no-final"])
async def test_a_long_event_passed_on_in_pieces_with_its_blank_line_split(
    final, stack: contextlib.AsyncExitStack, start_gateway, http
):
    """An event longer than what the buffer holds back (64 KiB) is passed on as it comes, and the
    read ends inside its closing blank line: the event was whole; what follows decides."""
    big = _typed("response.output_text.delta", {"type": "response.output_text.delta", "delta": "x" * 70_000})
    reads = [_R_CREATED, big[:30_000], big[30_000:-1], big[-1:], *([_R_DONE] if final else [])]
    text, errors = await _stream_of(stack, start_gateway, http, _chunked(*reads), "/v1/responses", _R_BODY)
    assert big.decode() in text
    if final:
        assert "event: error" not in text and text.endswith(_R_DONE.decode()), text[-300:]
        assert errors == 0
    else:
        assert _last_event(text).startswith("event: error\n"), text[-300:]
        assert errors == 1


# -- the event cutter alone, over every way reads can split a stream -------------------------

_VLLM_MESSAGES = [_M_OPENING, _M_DELTA, _M_DELTA, _M_STOP, b"data: [DONE]\n\n", b": keep-alive\n\n"]
_LONG_FINAL = _typed(None, {"response": {"instructions": "i" * 9000}, "type": "response.completed"})
_RESPONSES = [_R_CREATED, _R_DELTA, _typed(None, {"delta": "\\n\\n", "type": "response.output_text.delta"})]


def _verdict(stream: bytes, cuts: list[int], api: ApiKind) -> str | None:
    events = TypedEventBuffer()
    points = sorted({0, *cuts, len(stream)})
    for start, end in itertools.pairwise(points):
        events.complete(stream[start:end])
    _rest, failure = stream_end(events, True, api)
    return failure


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(min_value=0, max_value=20_000), max_size=12),
    st.booleans(),
    st.sampled_from(["messages", "responses", "responses-long-final"]),
)
def test_the_verdict_does_not_depend_on_how_reads_split_the_stream(cuts, crlf, case):
    if case == "messages":
        api, body, final = ApiKind.MESSAGES, _VLLM_MESSAGES, [_M_STOP, b"data: [DONE]\n\n"]
    else:
        api, body = ApiKind.RESPONSES, [*_RESPONSES, _LONG_FINAL if case.endswith("long-final") else _R_DONE]
        final = [body[-1]]
    whole = b"".join(body)
    cut_short = b"".join(part for part in body if part not in final)
    if crlf:
        whole, cut_short = whole.replace(b"\n", b"\r\n"), cut_short.replace(b"\n", b"\r\n")
    assert _verdict(whole, [c % (len(whole) + 1) for c in cuts], api) is None
    failure = _verdict(cut_short, [c % (len(cut_short) + 1) for c in cuts], api)
    assert failure is not None and "before its final event" in failure


def test_a_stream_read_byte_by_byte_is_named_as_when_read_whole():
    rng = random.Random(7)
    stream = b"".join(_VLLM_MESSAGES)
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(stream)), 40))
        assert _verdict(stream, cuts, ApiKind.MESSAGES) is None
    assert _verdict(stream, list(range(len(stream))), ApiKind.MESSAGES) is None
