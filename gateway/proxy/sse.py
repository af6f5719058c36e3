"""What the proxy reads out of an answer without parsing it all: SSE events, aborts."""

from __future__ import annotations

import json
from collections.abc import Callable

import msgspec

from gateway.errors import error_body
from gateway.proxy.upstream import UpstreamResponse
from gateway.proxy.upstream_response import ConnectionLost
from gateway.request.types import ApiKind, InferenceRequest

__all__ = [
    "SSE_DONE",
    "SSEEventBuffer",
    "aborted",
    "ends_event",
    "error_event",
    "events_end",
    "read_past_role_chunk",
]

SSE_DONE = b"data: [DONE]\n\n"

_MAX_HELD_BYTES = 16384
_MAX_PARTIAL_EVENT = 65536  # beyond this a "stream" is not SSE: pass it on as it comes


def ends_event(data: bytes) -> bool:
    return data.endswith((b"\n\n", b"\n\r\n"))  # LF, CRLF (\r\n\r\n) or mixed framing


def events_end(data: bytes | bytearray, start: int = 0) -> int:
    """Where the last event completed in ``data[start:]`` ends (its blank line's end), or 0 when
    none is: ``\\n\\n``, or ``\\n\\r\\n`` (CRLF framing's ``\\r\\n\\r\\n``, and a line's LF then a
    blank line's CRLF)."""
    lf = data.rfind(b"\n\n", start)
    mixed = data.rfind(b"\n\r\n", start)
    return max(lf + 2 if lf != -1 else 0, mixed + 3 if mixed != -1 else 0)


class SSEEventBuffer:
    """Cuts a byte stream at event boundaries: what :meth:`complete` returns ends with a blank
    line, the rest waits for the next chunk. An upstream that dies mid-event then never puts
    half an event in front of the client (whose SSE parser would fail on it instead of
    reading the error event that follows)."""

    __slots__ = ("_tail",)

    def __init__(self) -> None:
        self._tail = b""

    def complete(self, chunk: bytes) -> bytes:
        if self._tail:
            chunk = self._tail + chunk
            self._tail = b""
        if ends_event(chunk):  # the common case: engines write whole events
            return chunk
        cut = events_end(chunk)
        if len(chunk) - cut > _MAX_PARTIAL_EVENT:
            return chunk
        self._tail = chunk[cut:]
        return chunk[:cut]

    def flush(self) -> bytes:
        tail, self._tail = self._tail, b""
        return tail


def error_event(
    message: str,
    *,
    mid_event: bool,
    api: ApiKind = ApiKind.CHAT,
    code: str = "upstream_stream_error",
    error_type: str = "upstream_error",
) -> bytes:
    """An in-band SSE error; first ends an event the upstream left half-written, so the client's
    parser sees a broken event and then a well-formed error, not one glued line.

    Chat and completions: an OpenAI error object and ``[DONE]``. The typed-event APIs end with
    their own ``event: error``: Anthropic's ``{"type": "error", "error": {...}}`` for Messages,
    the Responses API's ``{"type": "error", "code", "message"}``; neither has ``[DONE]``.
    """
    prefix = b"\n\n" if mid_event else b""
    if api is ApiKind.MESSAGES:
        payload: dict[str, object] = {"type": "error", "error": {"type": "api_error", "message": message}}
        return prefix + b"event: error\ndata: " + json.dumps(payload).encode() + b"\n\n"
    if api is ApiKind.RESPONSES:
        payload = {"type": "error", "code": code, "message": message, "param": None}
        return prefix + b"event: error\ndata: " + json.dumps(payload).encode() + b"\n\n"
    event = error_body(message, error_type, code)
    return prefix + b"data: " + json.dumps(event).encode() + b"\n\n" + SSE_DONE


async def read_past_role_chunk(request: InferenceRequest, upstream: UpstreamResponse) -> bytes:
    """The first chunk of a stream, held until it carries real content.

    vLLM and SGLang open a chat stream with ``delta: {"role": "assistant", "content": ""}``
    before any token exists; a Messages stream with ``message_start`` (and an empty
    ``content_block_start``), a Responses stream with ``response.created`` /
    ``response.in_progress`` (and an empty output item / content part). Committing the
    client's response on such an opening would make a replica dying during prefill a
    mid-stream failure; holding it keeps the request retryable until a real token (or the
    end) arrives. A typed-event stream that ends after its opening alone is a broken one
    (:class:`ConnectionLost`, retried like any other).
    """
    chunk = await upstream.readany()
    if not chunk:  # a 200 stream with no event at all: broken, retried like any other
        # (committed, the client got an empty 200 with no error, and the replica a success)
        raise ConnectionLost("the stream ended before its first event", before_response=False)
    opening: Callable[[bytes], bool]
    if request.api is ApiKind.CHAT:
        if b'"role"' not in chunk or not _only_role(chunk):
            return chunk
        opening, limit = _only_role, _MAX_HELD_BYTES
    elif (typed := _TYPED_OPENING.get(request.api)) is not None:
        opening, limit = typed, _MAX_HELD_TYPED_BYTES
        if not opening(chunk):
            return chunk
    else:
        return chunk
    held = bytearray(chunk)
    checked = events_end(held)  # the events before this are opening ones
    while len(held) < limit:
        more = await upstream.readany()
        if not more:
            # Opening events (or keep-alive comments) and then the end: broken. A whole answer
            # that is no event stream at all (a JSON body) is passed on as chat's is, never
            # re-sent to every replica.
            if request.api is not ApiKind.CHAT and _has_event(bytes(held)):
                raise ConnectionLost(
                    "the stream ended after its opening events, before any content", before_response=False
                )
            break
        start = len(held)
        held += more
        if request.api is ApiKind.CHAT:  # the role chunk alone: held up to 16 KiB, checked whole
            if not opening(bytes(held)):
                break
            continue
        # Only the events completed by this read: re-checking all that is held per read made a
        # replica trickling pings cost time quadratic in their number, for up to first_byte_s.
        end = events_end(held, max(checked, start - 2))
        if end > checked:
            if not opening(bytes(held[checked:end])):
                break
            checked = end
    return bytes(held)


# Typed-event streams: the events that open a stream before the engine has produced anything,
# with, for those that start a block, the block types that are still empty when they start.
_OPENING_EVENTS: dict[ApiKind, dict[str, tuple[str, frozenset[str]] | None]] = {
    ApiKind.MESSAGES: {
        "message_start": None,
        "ping": None,
        "content_block_start": ("content_block", frozenset({"text", "thinking"})),
    },
    ApiKind.RESPONSES: {
        "response.created": None,
        "response.in_progress": None,
        "response.output_item.added": ("item", frozenset({"message", "reasoning"})),
        "response.content_part.added": None,
    },
}
_MAX_HELD_TYPED_BYTES = 262144  # response.created echoes the request's instructions and tools


def _typed_opening(kinds: dict[str, tuple[str, frozenset[str]] | None]) -> Callable[[bytes], bool]:
    def opening(buffer: bytes) -> bool:
        """True while every complete event so far only opens the stream (nothing to show yet)."""
        *events, _incomplete_tail = buffer.replace(b"\r\n", b"\n").split(b"\n\n")
        for event in events:
            lines = event.strip().splitlines()
            if all(line.startswith(b":") for line in lines):
                continue  # a comment (keep-alive): shows nothing, starts nothing
            data = b"".join(line[5:] for line in lines if line.startswith(b"data:"))
            try:
                payload = json.loads(data)
            except ValueError:
                return False
            if not isinstance(payload, dict) or payload.get("type") not in kinds:
                return False
            block = kinds[payload["type"]]
            if block is not None:
                field, empty_types = block
                part = payload.get(field)
                if not isinstance(part, dict) or part.get("type") not in empty_types:
                    return False
        return True

    return opening


_TYPED_OPENING = {api: _typed_opening(kinds) for api, kinds in _OPENING_EVENTS.items()}


def _has_event(buffer: bytes) -> bool:
    """Whether ``buffer`` holds a complete SSE event (an event stream, not some other body)."""
    return b"\n\n" in buffer.replace(b"\r\n", b"\n")


_decode = msgspec.json.Decoder().decode


def _only_role(buffer: bytes) -> bool:
    """True while every complete SSE event so far is a role-only chat delta (nothing to show yet)."""
    # CRLF framing too (sse-starlette's default separator): split on LF alone, such a stream
    # never showed a complete event and was held until 16 KB or its end
    if b"\r\n" in buffer:
        buffer = buffer.replace(b"\r\n", b"\n")
    start = 0
    # event by event, stopping at the first that shows something: a first chunk often holds
    # the whole answer, and splitting all of it was the larger part of this check's cost
    while (end := buffer.find(b"\n\n", start)) != -1:
        event = buffer[start:end].strip()
        start = end + 2
        if not event.startswith(b"data:"):
            return False
        try:
            payload = _decode(event[5:])  # msgspec: 7x json.loads on a chunk; NaN is not a role chunk
        except ValueError:
            return False
        if not isinstance(payload, dict) or payload.get("usage"):
            return False
        for choice in payload.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("finish_reason") is not None:
                return False
            delta = choice.get("delta")
            if not isinstance(delta, dict) or any(v for k, v in delta.items() if k != "role"):
                return False
    return True


def aborted(body: bytes) -> bool:
    """Every choice of a completed (non-streamed) response ended with ``finish_reason: "abort"``."""
    try:
        choices = json.loads(body).get("choices")
    except (ValueError, AttributeError):
        return False
    return (
        isinstance(choices, list)
        and bool(choices)
        and all(isinstance(c, dict) and c.get("finish_reason") == "abort" for c in choices)
    )
