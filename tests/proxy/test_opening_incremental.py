"""A typed stream's held opening is checked as each event completes (gateway/proxy/sse.py), not
by re-parsing everything held per read: the decision — committed at the first content event,
or broken after openings alone — is the whole-buffer check's, however the reads split the
events, their blank lines and their line endings."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.proxy import sse
from gateway.proxy.upstream_response import ConnectionLost
from gateway.request.types import ApiKind

_OPENING = [
    {"type": "response.created", "response": {"id": "r1", "instructions": "x" * 300}},
    {"type": "response.in_progress", "response": {"id": "r1"}},
    {"type": "response.output_item.added", "item": {"type": "message"}},
    {"type": "response.content_part.added", "part": {"type": "output_text"}},
]
_CONTENT = {"type": "response.output_text.delta", "delta": "Hi"}


class _Reads:
    """The upstream's body as the socket hands it over: these reads, then the end."""

    def __init__(self, pieces: list[bytes]) -> None:
        self._pieces = list(pieces)

    async def readany(self) -> bytes:
        return self._pieces.pop(0) if self._pieces else b""


def _whole_buffer_check(pieces: list[bytes]) -> bytes | str:
    """The check as it was: the whole held buffer parsed again after every read."""
    opening = sse._TYPED_OPENING[ApiKind.RESPONSES]
    reads = [*pieces, b""]
    held = bytearray(reads.pop(0))
    if not held:
        return "lost"
    if not opening(bytes(held)):
        return bytes(held)
    while len(held) < sse._MAX_HELD_TYPED_BYTES:
        more = reads.pop(0)
        if not more:
            return "lost" if sse._has_event(bytes(held)) else bytes(held)
        held += more
        if not opening(bytes(held)):
            break
    return bytes(held)


def _incremental(pieces: list[bytes]) -> bytes | str:
    request = SimpleNamespace(api=ApiKind.RESPONSES)
    try:
        return asyncio.run(sse.read_past_role_chunk(request, _Reads(pieces)))  # type: ignore[arg-type]
    except ConnectionLost:
        return "lost"


def _event(payload: dict, newline: str) -> str:
    return f"event: {payload['type']}{newline}data: {json.dumps(payload)}{newline}{newline}"


@settings(max_examples=300, deadline=None)
@given(
    openings=st.lists(st.sampled_from(range(len(_OPENING) + 1)), max_size=8),
    content=st.booleans(),
    newlines=st.lists(st.sampled_from(["\n", "\r\n"]), min_size=10, max_size=10),
    cuts=st.lists(st.integers(min_value=1, max_value=4000), max_size=12),
)
def test_the_opening_is_decided_as_the_whole_buffer_check_decides(openings, content, newlines, cuts) -> None:
    events = []
    for i, which in enumerate(openings):
        newline = newlines[i % len(newlines)]
        events.append(
            f": keep-alive{newline}{newline}" if which == len(_OPENING) else _event(_OPENING[which], newline)
        )
    if content:
        events.append(_event(_CONTENT, newlines[-1]))
    body = "".join(events).encode()
    points = sorted({c for c in cuts if c < len(body)})
    pieces = [body[a:b] for a, b in zip([0, *points], [*points, len(body)], strict=True) if body[a:b]]
    assert _incremental(pieces) == _whole_buffer_check(pieces)
