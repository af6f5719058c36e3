"""A zero-work OpenAI-compatible upstream for measuring router overhead.

``python -m loadtest.zero_upstream --port P [--workers N]``

Every answer is precomputed bytes written by a raw :class:`asyncio.Protocol` (uvloop when
installed) with a minimal HTTP/1.1 parser: keep-alive, pipelining, ``Content-Length`` and
chunked request bodies, ``Connection: close``. No framework, no per-request allocation
beyond slicing the input buffer, so a router in front of it is what gets measured.

Routes:

- ``GET /health`` (and ``/health_generate``, ``/ping``): 200, empty body;
- ``GET /v1/models``: one model, ``zero`` (``--model`` changes it);
- ``GET /metrics``: a few ``vllm:`` gauges, all 0;
- ``POST /v1/chat/completions`` and ``/v1/completions``: a fixed small JSON completion, or with
  ``"stream": true`` 8 SSE chunks (each its own ``transport.write``, i.e. its own TCP
  segment on loopback) followed by ``data: [DONE]``;
- SGLang's ``/get_server_info``, ``/get_model_info``, ``/get_load`` for routers that probe them;
- anything else: 404.

``--chunks N`` makes a streamed answer N events (8 by default): long streams measure the
per-event cost of a router apart from its per-request cost. ``--chunk-interval-ms N`` paces
a stream: one event every N ms (timers, no task per stream), so many long-lived streams
stay open at once (``loadtest.streams_bench``).

``--workers N`` forks N processes that each bind the port with ``SO_REUSEPORT``; the
kernel spreads connections across them. The parent forwards SIGTERM/SIGINT to them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import sys

__all__ = ["build_responses", "main", "serve"]

_MAX_HEADER_BYTES = 64 * 1024
_MAX_BODY_BYTES = 64 * 1024 * 1024
STREAM_CHUNKS = 8


def _response(status: str, content_type: str, body: bytes, *, close: bool = False) -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
    if close:
        head += "Connection: close\r\n"
    return head.encode() + b"\r\n" + body


def _json(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


_USAGE = {"prompt_tokens": 5, "completion_tokens": STREAM_CHUNKS, "total_tokens": 5 + STREAM_CHUNKS}


def _answers(model: str) -> dict[str, dict[str, object]]:
    """The non-streaming JSON bodies."""
    usage = _USAGE
    chat = {
        "id": "chatcmpl-zero",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "zero"}, "finish_reason": "stop"}
        ],
        "usage": usage,
    }
    completion = {
        "id": "cmpl-zero",
        "object": "text_completion",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "text": "zero", "finish_reason": "stop"}],
        "usage": usage,
    }
    models = {
        "object": "list",
        "data": [{"id": model, "object": "model", "created": 0, "owned_by": "zero", "max_model_len": 4096}],
    }
    server_info = {
        "model_path": model,
        "tokenizer_path": model,
        "served_model_name": model,
        "dp_size": 1,
        "tp_size": 1,
        "max_total_num_tokens": 100000,
        "internal_states": [{"load": 0}],
    }
    model_info = {
        "model_path": model,
        "tokenizer_path": model,
        "served_model_name": model,
        "is_generation": True,
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
    }
    return {"chat": chat, "completion": completion, "models": models, "server_info": server_info,
            "model_info": model_info}  # fmt: skip


def _metrics(model: str) -> bytes:
    return (
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{model_name="{model}"}} 0.0\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{model_name="{model}"}} 0.0\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f'vllm:kv_cache_usage_perc{{model_name="{model}"}} 0.0\n'
    ).encode()


def _streams(model: str, chunks: int = STREAM_CHUNKS) -> dict[str, tuple[bytes, ...]]:
    """The streaming answers: a tuple of socket writes each (head + first event, events, [DONE])."""
    usage = {"prompt_tokens": 5, "completion_tokens": chunks, "total_tokens": 5 + chunks}

    def sse_writes(make_chunk) -> tuple[bytes, ...]:
        head = (
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        events = [b"data: " + _json(make_chunk(i)) + b"\n\n" for i in range(chunks)]
        writes = [head + _chunk(events[0]), *(_chunk(e) for e in events[1:])]
        writes.append(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        return tuple(writes)

    def chat_chunk(i: int) -> dict[str, object]:
        delta: dict[str, str] = {"content": "z"}
        if i == 0:
            delta["role"] = "assistant"
        last = i == chunks - 1
        return {
            "id": "chatcmpl-zero",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": "stop" if last else None}],
            **({"usage": usage} if last else {}),
        }

    def completion_chunk(i: int) -> dict[str, object]:
        last = i == chunks - 1
        return {
            "id": "cmpl-zero",
            "object": "text_completion",
            "created": 0,
            "model": model,
            "choices": [{"index": 0, "text": "z", "finish_reason": "stop" if last else None}],
        }

    return {"stream_chat": sse_writes(chat_chunk), "stream_completion": sse_writes(completion_chunk)}


def build_responses(model: str, chunks: int = STREAM_CHUNKS) -> dict[str, object]:
    """Every answer as wire bytes: ``{key: bytes}`` plus ``stream_*``: a tuple of writes."""
    ok_json = "application/json"
    answers = _answers(model)
    return {
        "health": _response("200 OK", "text/plain", b""),
        "models": _response("200 OK", ok_json, _json(answers["models"])),
        "metrics": _response("200 OK", "text/plain; version=0.0.4", _metrics(model)),
        "server_info": _response("200 OK", ok_json, _json(answers["server_info"])),
        "model_info": _response("200 OK", ok_json, _json(answers["model_info"])),
        "load": _response("200 OK", ok_json, _json({"load": 0})),
        "chat": _response("200 OK", ok_json, _json(answers["chat"])),
        "completion": _response("200 OK", ok_json, _json(answers["completion"])),
        **_streams(model, chunks),
        "not_found": _response("404 Not Found", ok_json, _json({"error": {"message": "not found"}})),
        "bad_request": _response("400 Bad Request", ok_json, _json({"error": {"message": "bad request"}})),
    }


_GET_ROUTES = {
    b"/health": "health",
    b"/health_generate": "health",
    b"/ping": "health",
    b"/v1/models": "models",
    b"/metrics": "metrics",
    b"/get_server_info": "server_info",
    b"/server_info": "server_info",
    b"/get_model_info": "model_info",
    b"/model_info": "model_info",
    b"/get_load": "load",
}
_POST_ROUTES = {b"/v1/chat/completions": "chat", b"/v1/completions": "completion"}


def _wants_stream(body: bytes) -> bool:
    if b'"stream"' not in body:  # fast path: most bodies never mention it
        return False
    try:
        parsed = json.loads(body)
    except ValueError:
        return False
    return isinstance(parsed, dict) and parsed.get("stream") is True


class _BadRequest(Exception):
    pass


class ZeroProtocol(asyncio.Protocol):
    """One connection: parse as many complete requests as the buffer holds, answer each."""

    __slots__ = ("_buf", "_closing", "_interval_s", "_responses", "_transport")

    def __init__(self, responses: dict[str, object], interval_s: float = 0.0) -> None:
        self._responses = responses
        self._interval_s = interval_s
        self._buf = b""
        self._transport: asyncio.Transport | None = None
        self._closing = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None

    def data_received(self, data: bytes) -> None:
        buf = self._buf + data if self._buf else data
        try:
            while buf and not self._closing:
                consumed = self._handle_one(buf)
                if consumed == 0:
                    break
                buf = buf[consumed:]
        except _BadRequest:
            self._write(self._responses["bad_request"], close=True)
            buf = b""
        if len(buf) > _MAX_BODY_BYTES + _MAX_HEADER_BYTES:
            self._write(self._responses["bad_request"], close=True)
            buf = b""
        self._buf = buf

    def _write(self, payload: object, *, close: bool = False) -> None:
        transport = self._transport
        if transport is None:
            return
        if isinstance(payload, tuple):
            if self._interval_s > 0:
                transport.write(payload[0])
                loop = asyncio.get_running_loop()
                for i, part in enumerate(payload[1:], start=1):
                    loop.call_later(i * self._interval_s, self._paced, transport, part)
                return
            for part in payload:
                transport.write(part)
        else:
            transport.write(payload)  # type: ignore[arg-type]
        if close:
            self._closing = True
            transport.close()

    @staticmethod
    def _paced(transport: asyncio.Transport, part: bytes) -> None:
        if not transport.is_closing():
            transport.write(part)

    def _handle_one(self, buf: bytes) -> int:
        """Answer the first request in ``buf``; return the bytes it used, 0 if incomplete."""
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > _MAX_HEADER_BYTES:
                raise _BadRequest
            return 0
        head = buf[:end]
        lines = head.split(b"\r\n")
        try:
            method, target, version = lines[0].split(b" ", 2)
        except ValueError:
            raise _BadRequest from None
        length = 0
        chunked = False
        keep_alive = version == b"HTTP/1.1"
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    raise _BadRequest from None
                if length < 0 or length > _MAX_BODY_BYTES:
                    raise _BadRequest
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"connection":
                token = value.strip().lower()
                if token == b"close":
                    keep_alive = False
                elif token == b"keep-alive":
                    keep_alive = True
        start = end + 4
        if chunked:
            parsed = _read_chunked(buf, start)
            if parsed is None:
                return 0
            body, consumed = parsed
        else:
            consumed = start + length
            if len(buf) < consumed:
                return 0
            body = buf[start:consumed]
        path = target.split(b"?", 1)[0]
        responses = self._responses
        if method == b"POST" and path in _POST_ROUTES:
            key = _POST_ROUTES[path]
            payload = responses["stream_" + key] if _wants_stream(body) else responses[key]
        elif method in (b"GET", b"HEAD") and path in _GET_ROUTES:
            payload = responses[_GET_ROUTES[path]]
        else:
            payload = responses["not_found"]
        self._write(payload, close=not keep_alive)
        return consumed


def _read_chunked(buf: bytes, pos: int) -> tuple[bytes, int] | None:
    """Decode a chunked body starting at ``pos``; ``None`` while incomplete."""
    parts = []
    while True:
        line_end = buf.find(b"\r\n", pos)
        if line_end < 0:
            return None
        try:
            size = int(buf[pos:line_end].split(b";", 1)[0], 16)
        except ValueError:
            raise _BadRequest from None
        pos = line_end + 2
        if size == 0:
            trailer_end = buf.find(b"\r\n\r\n", pos - 2)
            if trailer_end < 0:
                return None
            return b"".join(parts), trailer_end + 4
        if len(buf) < pos + size + 2:
            return None
        parts.append(buf[pos : pos + size])
        pos += size + 2


def _listen_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(4096)
    sock.setblocking(False)
    return sock


async def serve(
    host: str,
    port: int,
    model: str = "zero",
    *,
    reuse_port: bool = False,
    interval_s: float = 0.0,
    chunks: int = STREAM_CHUNKS,
) -> None:
    """Serve until SIGTERM/SIGINT."""
    loop = asyncio.get_running_loop()
    responses = build_responses(model, chunks)
    sock = _listen_socket(host, port, reuse_port)
    server = await loop.create_server(lambda: ZeroProtocol(responses, interval_s), sock=sock, backlog=4096)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def _run(
    host: str, port: int, model: str, reuse_port: bool, interval_s: float = 0.0, chunks: int = STREAM_CHUNKS
) -> None:
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    asyncio.run(serve(host, port, model, reuse_port=reuse_port, interval_s=interval_s, chunks=chunks))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.zero_upstream", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--workers", type=int, default=1, help="processes sharing the port (SO_REUSEPORT)")
    parser.add_argument("--model", default="zero")
    parser.add_argument("--chunk-interval-ms", type=float, default=0.0, help="pace streamed events")
    parser.add_argument("--chunks", type=int, default=STREAM_CHUNKS, help="events per streamed answer")
    args = parser.parse_args(argv)
    if args.chunks < 1:
        parser.error("--chunks must be at least 1")
    interval_s = args.chunk_interval_ms / 1000
    if args.workers <= 1:
        _run(args.host, args.port, args.model, False, interval_s, args.chunks)
        return 0
    children: list[int] = []
    for _ in range(args.workers):
        pid = os.fork()
        if pid == 0:  # child
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            try:
                _run(args.host, args.port, args.model, True, interval_s, args.chunks)
            finally:
                os._exit(0)
        children.append(pid)

    def forward(signum: int, _frame: object) -> None:
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    for child in children:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(child, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
