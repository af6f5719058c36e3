"""One OpenAI-style client for benchmarks: a request, streamed (SSE) or not, and what it saw.

It reports the HTTP status, the replica that answered (``x-gateway-endpoint``), TTFT and
inter-token gaps, how many SSE data events arrived, in-band error events, whether the
stream ended with ``[DONE]``, the usage block and the answer text. Failures are sorted
into one ``outcome``: ``ok | http_<status> | stream_error | truncated | timeout |
connection | bad_payload | cancelled``. It never raises for what the server did; a
cancellation is recorded and re-raised.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

__all__ = ["ENDPOINT_HEADER", "Exchange", "chunk_text", "send"]

ENDPOINT_HEADER = "x-gateway-endpoint"


@dataclass(slots=True)
class Exchange:
    """One request as the client saw it; times in seconds from when it was started."""

    status: int = 0  # HTTP status, 0 when none arrived
    endpoint: str | None = None
    outcome: str = "pending"
    error: str | None = None
    events: int = 0  # SSE data events, [DONE] included (a chat stream opens with a role-only one)
    done: bool = False  # the stream ended with data: [DONE]
    content_chunks: int = 0  # events that carried answer text
    ttft: float | None = None  # first content chunk (non-streaming: the whole answer)
    itls: list[float] = field(default_factory=list)
    latency: float | None = None
    usage: dict[str, Any] | None = None
    text: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"


def chunk_text(kind: str, payload: dict[str, Any], delta: bool = True) -> str:
    """The answer text in one chunk (``delta``) or one whole response, chat or completion."""
    choices = payload.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if kind == "completion":
        return choice.get("text") or ""
    return (choice.get("delta" if delta else "message") or {}).get("content") or ""


def _fail(ex: Exchange, outcome: str, error: str, limit: int) -> None:
    ex.outcome, ex.error = outcome, error[:limit]


async def _read_stream(
    resp: aiohttp.ClientResponse, kind: str, ex: Exchange, sent: float, limit: int
) -> None:
    parts: list[str] = []
    last: float | None = None
    try:
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            ex.events += 1
            if data == b"[DONE]":
                ex.done = True
                break
            chunk = json.loads(data)
            if "error" in chunk and not chunk.get("choices"):
                _fail(ex, "stream_error", json.dumps(chunk["error"]), limit)
                continue  # the gateway follows its error event with [DONE]
            if chunk.get("usage"):
                ex.usage = chunk["usage"]
            text = chunk_text(kind, chunk)
            if text:
                now = time.perf_counter()
                if last is None:
                    ex.ttft = now - sent
                else:
                    ex.itls.append(now - last)
                last = now
                ex.content_chunks += 1
                parts.append(text)
    finally:
        ex.text = "".join(parts)


async def _exchange(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    kind: str,
    ex: Exchange,
    sent: float,
    limit: int,
    require_done: bool,
) -> None:
    async with session.post(url, json=body, headers=headers) as resp:
        ex.status = resp.status
        ex.endpoint = resp.headers.get(ENDPOINT_HEADER, ex.endpoint)
        if resp.status != 200:
            text = (await resp.text()) or resp.reason or "http error"
            _fail(ex, f"http_{resp.status}", text, limit)
        elif body.get("stream"):
            await _read_stream(resp, kind, ex, sent, limit)
            if ex.outcome == "pending" and not ex.done and require_done:
                _fail(ex, "truncated", "stream ended without [DONE]", limit)
        else:
            payload = await resp.json(content_type=None)
            ex.text = chunk_text(kind, payload, delta=False)
            ex.usage = payload.get("usage")
            ex.ttft = time.perf_counter() - sent
    if ex.outcome == "pending":
        ex.outcome = "ok"


async def send(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    *,
    kind: str = "chat",
    sent: float | None = None,
    timeout_s: float | None = None,
    require_done: bool = True,
    error_chars: int = 300,
    out: Exchange | None = None,
) -> Exchange:
    """POST ``body`` to ``url`` (streamed when ``body["stream"]``) and fill an :class:`Exchange`.

    ``sent``: the ``perf_counter()`` at which the caller started the request (TTFT and
    latency count from it). ``timeout_s``: the whole exchange, answer included.
    ``require_done=False`` accepts a stream that just ends. ``out`` is filled in place, so
    a caller still has it when the request is cancelled.
    """
    ex = out if out is not None else Exchange()
    started = time.perf_counter() if sent is None else sent
    try:
        async with asyncio.timeout(timeout_s):
            await _exchange(session, url, body, headers or {}, kind, ex, started, error_chars, require_done)
    except TimeoutError as exc:
        own = timeout_s is not None and not isinstance(exc, aiohttp.ClientError)
        text = f"no complete answer within {timeout_s:g}s" if own else f"{type(exc).__name__}: {exc}"
        _fail(ex, "timeout", text, error_chars)
    except aiohttp.ClientPayloadError as exc:
        _fail(ex, "truncated", f"{type(exc).__name__}: {exc}", error_chars)
    except aiohttp.ClientError as exc:
        _fail(ex, "connection", f"{type(exc).__name__}: {exc}", error_chars)
    except ValueError as exc:
        _fail(ex, "bad_payload", f"{type(exc).__name__}: {exc}", error_chars)
    except asyncio.CancelledError:
        if ex.outcome in ("pending", "ok"):
            _fail(ex, "cancelled", "cancelled (deadline)", error_chars)
        raise
    finally:
        ex.latency = time.perf_counter() - started
    return ex
