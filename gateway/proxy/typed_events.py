"""Whether a Messages or Responses stream that ended cleanly ended whole: on its final event.

A chat stream's end is its ``[DONE]`` or nothing at all (engines differ), but the typed-event
APIs always close with a named final event (``message_stop``; ``response.completed`` and its
failed / incomplete siblings), or an ``error``. An engine that dies behind a proxy that then
ends the chunked body properly, or a replica that closes a close-delimited body between two
events, leaves a stream of whole events that stops short; passed on as a success, the SDK
reads an answer without its end (an agent's turn with no final usage, no stop reason).

The check reads the stream event by event, as the client's SSE parser does: events are cut
at blank lines only (a JSON string holds no raw line end, so no text inside an event can
look like one), a comment or ``data: [DONE]`` (vLLM's Messages route sends one after
``message_stop``) is no event of the API, and an event is named by its ``event:`` line, else
by its data's ``type`` when the event is small enough to decode. An event that cannot be
named (a large data-only event) counts as possibly final: the check only ever flags a
stream whose last event is known not to be final.
"""

from __future__ import annotations

import msgspec

from gateway.proxy.sse import SSEEventBuffer, events_end
from gateway.request.types import ApiKind

__all__ = ["FINAL_EVENTS", "TypedEventBuffer", "event_buffer", "stream_end"]

FINAL_EVENTS: dict[ApiKind, frozenset[str]] = {
    ApiKind.MESSAGES: frozenset({"message_stop", "error"}),
    ApiKind.RESPONSES: frozenset({"response.completed", "response.failed", "response.incomplete", "error"}),
}

# The first bytes of an event kept to name it: the event line, or a delta's whole data.
_HEAD = 4096
_UNNAMED = ""  # an event of the API whose name could not be read: possibly the final one

_decode = msgspec.json.Decoder().decode


class TypedEventBuffer(SSEEventBuffer):
    """An :class:`SSEEventBuffer` that also names the last event of the stream read so far.

    Every byte of the stream enters through :meth:`complete` once (what it holds back is
    read again there only as the start of a later call's input, not tracked twice)."""

    __slots__ = ("_current", "_current_whole", "_edge", "_last")

    def __init__(self) -> None:
        super().__init__()
        self._current = b""  # the first bytes of the event being read
        self._current_whole = True  # whether _current is all of it so far
        self._edge = b""  # the stream's last two bytes, when _current is not all of its event
        # the last API event: its name, or the whole event to name it by (parsed only if it
        # stays the last: 20 µs an event for a 3 KB data-only delta); None: no API event yet
        self._last: str | bytes | None = None

    @property
    def last_event(self) -> str | None:
        """The last API event's name; ``_UNNAMED`` when it cannot be read; None: none yet."""
        if isinstance(self._last, bytes):
            self._last = _data_type(self._last)
        return self._last

    def complete(self, chunk: bytes) -> bytes:
        if chunk:
            self._track(chunk)
        return super().complete(chunk)

    def _track(self, data: bytes) -> None:
        # the engines' way: whole events per read, LF framing, the event line first
        if not self._current and data.endswith(b"\n\n") and b"\r" not in data:
            cut = data.rfind(b"\n\n", 0, -2)
            start = cut + 2 if cut != -1 else 0
            if data.startswith(b"event:", start):  # named on its first line: the last event's name
                self._last = data[start + 6 : data.index(b"\n", start)].strip().decode("utf-8", "replace")
                return
            if data.startswith(b"data:", start) and len(data) - start <= _HEAD:
                found = _api_event(data[start:-2], whole=True)
                if found is not None:  # else ([DONE]) an earlier event of this read may be the last
                    self._last = found
                    return
        whole = self._current_whole
        view = (self._current if whole else self._edge) + data
        end = events_end(view)
        if end:
            # the events completed by this read, the last first; only the first may have
            # started in an earlier read (its start is then _current)
            events = view[:end].replace(b"\r\n", b"\n").split(b"\n\n")
            for index in range(len(events) - 2, -1, -1):
                if index == 0 and not whole:
                    found = _api_event(self._current, whole=False)
                else:
                    found = _api_event(events[index][:_HEAD], whole=len(events[index]) <= _HEAD)
                if found is not None:
                    self._last = found
                    break
            view, whole = view[end:], True
        if whole and len(view) <= _HEAD:
            self._current, self._current_whole = view, True
            return
        if whole:  # an event longer than what is kept of it: its head, and the edge to cut at
            self._current, self._current_whole = view[:_HEAD], False
        self._edge = view[-2:]


def _api_event(event: bytes, *, whole: bool) -> str | bytes | None:
    """An API event's name from its event line, or the whole event to name it by later; None
    for no API event (a comment, ``[DONE]``, blank lines); ``_UNNAMED`` for one whose name
    cannot be read from what is kept of it (a long event: only its head is kept, which may
    hold neither line)."""
    if whole and event.startswith(b"data:"):  # data-only servers: kept as it is, named if last
        return None if len(event) < 32 and event[5:].strip() == b"[DONE]" else event
    return _lines_name(event, whole=whole)


def _lines_name(event: bytes, *, whole: bool) -> str | bytes | None:
    """:func:`_api_event` by its lines: the name, or the data of a whole event."""
    data = []
    for line in event.split(b"\n"):
        if line.startswith(b"event:"):
            return line[6:].strip().decode("utf-8", "replace")
        if line.startswith(b"data:"):
            data.append(line[5:])
    if not data:
        return None if whole else _UNNAMED
    payload = b"\n".join(data).strip()
    if payload == b"[DONE]":
        return None
    return payload if whole else _UNNAMED


def _data_type(event: bytes) -> str:
    """The name of a whole event kept to be named later: its event line, else the ``type`` of its
    JSON data, else ``_UNNAMED``."""
    found = _lines_name(event, whole=True)
    if not isinstance(found, bytes):
        return found or _UNNAMED
    try:
        decoded = _decode(found)
    except (msgspec.DecodeError, ValueError):
        return _UNNAMED
    kind = decoded.get("type") if isinstance(decoded, dict) else None
    return kind if isinstance(kind, str) else _UNNAMED


def event_buffer(api: ApiKind) -> SSEEventBuffer:
    """The stream's event cutter: typed-event APIs' names their events too."""
    return TypedEventBuffer() if api in FINAL_EVENTS else SSEEventBuffer()


def stream_end(events: SSEEventBuffer, sse: bool, api: ApiKind) -> tuple[bytes, str | None]:
    """At the clean end of a stream's body: what is left to write, and why the stream is
    broken after all (None when it is whole).

    An event left unterminated is dropped (an SSE client discards it anyway) and the stream
    is broken: a close-delimited body that closes mid-event, or an engine that died behind a
    proxy that ended the chunked body properly. Line ends alone are no event (the rest of a
    blank line, after an event passed on in pieces). A typed-event stream whose last event is
    known not to be its API's final one is broken too. A body that is no event stream at all
    (``sse`` false) is passed on as it came.
    """
    rest = events.flush()
    if not sse:
        return rest, None
    if rest.strip(b"\r\n"):
        return b"", "upstream stream ended in the middle of an event"
    last = events.last_event if isinstance(events, TypedEventBuffer) else None
    if last is None or last == _UNNAMED or last in FINAL_EVENTS[api]:
        return rest, None
    return rest, f"upstream stream ended before its final event (its last: {last[:64]!r})"
