"""SSEEventBuffer: only whole events pass; partial ones wait; non-SSE floods are not held."""

from __future__ import annotations

from gateway.proxy.sse import SSEEventBuffer


def test_whole_events_pass_at_once_and_a_tail_waits_for_its_end() -> None:
    events = SSEEventBuffer()
    assert events.complete(b"data: 1\n\n") == b"data: 1\n\n"
    assert events.complete(b"data: 2\n\ndata: 3") == b"data: 2\n\n"
    assert events.complete(b"") == b""
    assert events.complete(b"3\n\n") == b"data: 33\n\n"
    assert events.flush() == b""


def test_crlf_framing_is_an_event_boundary_too() -> None:
    events = SSEEventBuffer()
    assert events.complete(b"data: a\r\n\r\ndata: b") == b"data: a\r\n\r\n"
    assert events.complete(b"\r\n\r\n") == b"data: b\r\n\r\n"


def test_a_chunk_without_any_boundary_is_held_and_flushed_at_the_end() -> None:
    events = SSEEventBuffer()
    assert events.complete(b'data: {"par') == b""
    assert events.flush() == b'data: {"par'
    assert events.flush() == b""


def test_a_stream_that_is_not_sse_is_not_buffered_without_bound() -> None:
    events = SSEEventBuffer()
    blob = b"x" * 70_000
    assert events.complete(blob) == blob
