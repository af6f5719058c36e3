"""``gateway.proxy.upstream``: our HTTP/1.1 keep-alive client, against raw asyncio servers.

Every server here is a plain ``asyncio.start_server`` on 127.0.0.1 that writes the exact
bytes a test wants (no HTTP framework in between), so framing, reuse and failures are what
the bytes say. Close-delimited bodies, TLS and URL path prefixes are covered elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from gateway.proxy.upstream import ConnectFailed, ConnectionLost, UpstreamClient

OK_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"


class Conn:
    """One accepted connection and the requests read from it."""

    def __init__(self, index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.index = index
        self.reader = reader
        self.writer = writer
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        self.eof = asyncio.Event()  # the client closed (or aborted) this connection

    async def read_request(self) -> tuple[str, dict[str, str], bytes] | None:
        """One request (head + Content-Length body), or None at EOF."""
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            self.eof.set()
            return None
        lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        body = await self.reader.readexactly(int(headers.get("content-length", "0")))
        request = (lines[0], headers, body)
        self.requests.append(request)
        return request

    async def wait_eof(self) -> None:
        """Read until the client goes away."""
        with contextlib.suppress(ConnectionError):
            while await self.reader.read(65536):
                pass
        self.eof.set()

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    def close(self) -> None:
        self.writer.close()


Handler = Callable[[Conn], Awaitable[None]]


class RawServer:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections: list[Conn] = []
        self.url = ""
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> RawServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        conn = Conn(len(self.connections), reader, writer)
        self.connections.append(conn)
        try:
            await self.handler(conn)
        except (ConnectionError, asyncio.IncompleteReadError):
            conn.eof.set()
        except asyncio.CancelledError:
            pass  # stopped by the test's teardown: end quietly (asyncio logs a cancelled callback task)
        finally:
            self._tasks.discard(task)
            writer.close()

    @property
    def requests(self) -> list[tuple[str, dict[str, str], bytes]]:
        return [r for c in self.connections for r in c.requests]

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def fixed(body: bytes, extra_head: bytes = b"") -> bytes:
    return OK_HEAD + extra_head + b"Content-Length: %d\r\n\r\n" % len(body) + body


async def answer_every_request(conn: Conn, body: bytes = b'{"ok":true}') -> None:
    """Keep-alive server: one fixed-length answer per request until the client leaves."""
    while await conn.read_request() is not None:
        await conn.send(fixed(body))


@pytest.fixture
async def serve(stack: contextlib.AsyncExitStack):
    async def start(handler: Handler) -> RawServer:
        server = await RawServer(handler).start()
        stack.push_async_callback(server.stop)
        return server

    return start


@pytest.fixture
async def make_client(stack: contextlib.AsyncExitStack):
    def make(limit_per_endpoint: int = 0, idle_timeout_s: float = 30.0) -> UpstreamClient:
        client = UpstreamClient(
            connect_timeout_s=2.0, limit_per_endpoint=limit_per_endpoint, idle_timeout_s=idle_timeout_s
        )
        stack.push_async_callback(client.close)
        return client

    return make


@contextlib.asynccontextmanager
async def within(seconds: float = 2.0) -> AsyncIterator[None]:
    async with asyncio.timeout(seconds):
        yield


async def post(client: UpstreamClient, server: RawServer, body: bytes = b"{}", **kw):
    async with within():
        return await client.post(server.url, "/v1/chat/completions", body, {}, **kw)


# -- framing and the request bytes ------------------------------------------------------


async def test_content_length_response_and_the_request_as_sent(serve, make_client):
    server = await serve(lambda c: answer_every_request(c, b"hello world"))
    client = make_client()
    async with within():
        resp = await client.post(
            server.url, "/v1/completions", b'{"a":1}', {"Authorization": "Bearer t", "X-Request-Id": "r1"}
        )
        assert resp.status == 200
        assert resp.content_type == "application/json"
        assert resp.headers["content-length"] == "11"  # names lower-cased
        assert await resp.read() == b"hello world"
        resp.release()
    (line, headers, body) = server.requests[0]
    assert line == "POST /v1/completions HTTP/1.1"
    assert headers["host"] == server.url.removeprefix("http://")
    assert headers["authorization"] == "Bearer t"
    assert headers["x-request-id"] == "r1"
    assert headers["content-length"] == "7"
    assert body == b'{"a":1}'


async def test_chunked_body_is_decoded_and_the_connection_kept(serve, make_client):
    async def chunked(conn: Conn) -> None:
        while await conn.read_request() is not None:
            await conn.send(
                OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
            )

    server = await serve(chunked)
    client = make_client()
    for _ in range(2):
        resp = await post(client, server)
        async with within():
            assert await resp.read() == b"hello world"
        resp.release()
    assert len(server.connections) == 1
    assert len(server.requests) == 2


async def test_readany_hands_over_bytes_as_they_arrive(serve, make_client):
    go = asyncio.Event()

    async def streaming(conn: Conn) -> None:
        await conn.read_request()
        await conn.send(OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await go.wait()
        await conn.send(b"6\r\nsecond\r\n0\r\n\r\n")
        await conn.wait_eof()

    server = await serve(streaming)
    client = make_client()
    resp = await post(client, server)
    async with within():
        assert await resp.readany() == b"first"  # before the server even wrote the rest
        assert not go.is_set()
        go.set()
        assert await resp.readany() == b"second"
        assert await resp.readany() == b""
        assert await resp.readany() == b""  # the end stays the end
    resp.release()


async def test_large_body_arrives_intact_through_back_pressure(serve, make_client):
    big = bytes(range(256)) * 8192  # 2 MiB: well past the client's high-water mark

    async def slow_reader_server(conn: Conn) -> None:
        while await conn.read_request() is not None:
            await conn.send(fixed(big))

    server = await serve(slow_reader_server)
    client = make_client()
    resp = await post(client, server)
    parts = []
    async with within(5):
        while chunk := await resp.readany():
            parts.append(chunk)
            await asyncio.sleep(0)  # a consumer slower than the socket
    assert b"".join(parts) == big
    resp.release()
    resp = await post(client, server)  # still a usable keep-alive connection
    async with within(5):
        assert await resp.read() == big
    resp.release()
    assert len(server.connections) == 1


async def test_bytes_left_unread_by_back_pressure_never_become_the_next_answer(serve, make_client):
    """An answer whose end is read in the read that stops reading (back pressure), then bytes
    nobody asked for while reading stays stopped: they wait in the kernel. The next request,
    made before the loop polls the socket again, must not take them for its answer."""
    big = b"x" * (512 * 1024 + 1)  # its last byte is the one that crosses the high-water mark
    stray = fixed(b"POISON")

    async def stray_after_the_end(conn: Conn) -> None:
        while (request := await conn.read_request()) is not None:
            await conn.send(fixed(big if request[2] == b"big" else b"fresh"))
            if request[2] == b"big":
                await asyncio.sleep(0.05)
                await conn.send(stray)

    server = await serve(stray_after_the_end)
    client = make_client()
    resp = await post(client, server, b"big")
    await asyncio.sleep(0.3)  # the stray bytes arrive while reading is paused
    async with within():
        assert await resp.read() == big
    resp.release()
    resp = await post(client, server, b"small")  # same task step: no poll in between
    async with within():
        assert await resp.read() == b"fresh"
    resp.release()
    assert len(server.connections) == 2


# -- keep-alive, release and close ----------------------------------------------------


async def test_keep_alive_reuses_one_connection(serve, make_client):
    server = await serve(answer_every_request)
    client = make_client()
    for _ in range(3):
        resp = await post(client, server)
        async with within():
            await resp.read()
        resp.release()
    assert len(server.connections) == 1
    assert len(server.requests) == 3


async def test_close_aborts_the_connection_and_the_next_request_opens_a_new_one(serve, make_client):
    server = await serve(answer_every_request)
    client = make_client()
    resp = await post(client, server)
    async with within():
        await resp.read()
    resp.close()
    async with within():
        await server.connections[0].eof.wait()  # the upstream sees the client go away
    resp = await post(client, server)
    async with within():
        await resp.read()
    resp.release()
    assert len(server.connections) == 2


async def test_release_before_the_end_of_the_body_does_not_reuse_the_connection(serve, make_client):
    async def half_on_first_connection(conn: Conn) -> None:
        while await conn.read_request() is not None:
            if conn.index == 0:
                await conn.send(OK_HEAD + b"Content-Length: 10\r\n\r\n12345")
                await conn.wait_eof()
                return
            await conn.send(fixed(b"1234567890"))

    server = await serve(half_on_first_connection)
    client = make_client()
    resp = await post(client, server)
    async with within():
        assert await resp.readany() == b"12345"
    resp.release()  # unread bytes still due on the wire: this connection cannot carry another request
    async with within():
        await server.connections[0].eof.wait()
    resp = await post(client, server)
    async with within():
        assert await resp.read() == b"1234567890"
    resp.release()
    assert len(server.connections) == 2


async def test_connection_close_header_is_honoured(serve, make_client):
    async def close_after(conn: Conn) -> None:
        if await conn.read_request() is not None:
            await conn.send(fixed(b"bye", b"Connection: close\r\n"))
            await conn.wait_eof()

    server = await serve(close_after)
    client = make_client()
    for _ in range(2):
        resp = await post(client, server)
        async with within():
            assert await resp.read() == b"bye"
        resp.release()
    assert len(server.connections) == 2
    assert [len(c.requests) for c in server.connections] == [1, 1]


async def test_idle_connection_older_than_the_idle_timeout_is_not_reused(serve, make_client):
    server = await serve(answer_every_request)
    client = make_client(idle_timeout_s=0.05)
    resp = await post(client, server)
    async with within():
        await resp.read()
    resp.release()
    await asyncio.sleep(0.15)
    resp = await post(client, server)
    async with within():
        await resp.read()
    resp.release()
    assert len(server.connections) == 2
    async with within():
        await server.connections[0].eof.wait()  # the expired one was closed, not leaked


async def test_idle_connection_closed_by_the_server_is_not_used(serve, make_client):
    async def one_then_close(conn: Conn) -> None:
        if await conn.read_request() is not None:
            await conn.send(fixed(b"one"))  # keep-alive promised, then closed while idle

    server = await serve(one_then_close)
    client = make_client()
    for _ in range(2):
        resp = await post(client, server)
        async with within():
            assert await resp.read() == b"one"
        resp.release()
        await asyncio.sleep(0.05)  # the close reaches the client while the connection is idle
    assert len(server.connections) == 2


async def test_reused_connection_closed_as_the_request_arrives_is_retried_once(serve, make_client):
    async def drop_second_on_first_connection(conn: Conn) -> None:
        while await conn.read_request() is not None:
            if conn.index == 0 and len(conn.requests) == 2:
                return  # the server timed the connection out just as the request came in
            await conn.send(fixed(b"x%d" % conn.index))

    server = await serve(drop_second_on_first_connection)
    client = make_client()
    resp = await post(client, server, b"first")
    async with within():
        assert await resp.read() == b"x0"
    resp.release()
    resp = await post(client, server, b"second")
    async with within():
        assert await resp.read() == b"x1"  # transparently re-sent on a fresh connection
    resp.release()
    assert [[r[2] for r in c.requests] for c in server.connections] == [[b"first", b"second"], [b"second"]]


async def test_remove_closes_idle_connections(serve, make_client):
    server = await serve(answer_every_request)
    client = make_client()
    resp = await post(client, server)
    async with within():
        await resp.read()
    resp.release()
    client.remove(server.url)
    async with within():
        await server.connections[0].eof.wait()


# -- failures -------------------------------------------------------------------------------


async def test_server_closing_before_answering_is_connection_lost_before_response(serve, make_client):
    async def read_and_close(conn: Conn) -> None:
        await conn.read_request()

    server = await serve(read_and_close)
    client = make_client()
    with pytest.raises(ConnectionLost) as caught:
        await post(client, server)
    assert caught.value.before_response is True
    assert len(server.connections) == 1  # a fresh connection that failed is not retried
    assert len(server.requests) == 1


async def test_connection_lost_mid_body(serve, make_client):
    async def cut(conn: Conn) -> None:
        await conn.read_request()
        await conn.send(OK_HEAD + b"Content-Length: 100\r\n\r\n0123456789")

    server = await serve(cut)
    client = make_client()
    resp = await post(client, server)
    assert resp.status == 200
    async with within():
        assert await resp.readany() == b"0123456789"
        with pytest.raises(ConnectionLost) as caught:
            await resp.readany()
    assert caught.value.before_response is False
    with pytest.raises(ConnectionLost):
        await resp.read()  # the failure stays: a consumer cannot mistake it for the end
    resp.close()


async def test_connection_refused_is_connect_failed(make_client):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens here once the socket is closed
    client = make_client(limit_per_endpoint=1)
    for _ in range(2):  # the slot was released: the second attempt fails the same way, at once
        with pytest.raises(ConnectFailed, match=f"127.0.0.1:{port}"):
            async with within():
                await client.post(f"http://127.0.0.1:{port}", "/v1/completions", b"{}", {})


@pytest.mark.parametrize(
    "head",
    [
        b"FOO BAR\r\n\r\n",
        b"HTTP/1.1 abc OK\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: nope\r\n\r\n",
        b"\x00\x01\x02\r\n\r\n",
    ],
    ids=["not-http", "status-not-a-number", "bad-content-length", "binary"],
)
async def test_nonsense_status_line_is_a_lost_connection(head, serve, make_client):
    async def nonsense(conn: Conn) -> None:
        if await conn.read_request() is not None:
            await conn.send(head)
            await conn.wait_eof()

    server = await serve(nonsense)
    client = make_client()
    with pytest.raises(ConnectionLost, match="malformed") as caught:
        await post(client, server)
    assert caught.value.before_response is True
    async with within():
        await server.connections[0].eof.wait()  # that connection is dropped, never pooled


async def test_a_hanging_server_is_cut_by_the_callers_timeout(serve, make_client):
    async def hang_first(conn: Conn) -> None:
        while await conn.read_request() is not None:
            if conn.index == 0:
                await conn.wait_eof()  # never answers
                return
            await conn.send(fixed(b"late"))

    server = await serve(hang_first)
    client = make_client(limit_per_endpoint=1)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.2):  # the client has no read timeout of its own
            await client.post(server.url, "/v1/completions", b"{}", {})
    async with within():
        await server.connections[0].eof.wait()  # the cancelled request's socket was aborted
    resp = await post(client, server)  # and its slot was given back
    async with within():
        assert await resp.read() == b"late"
    resp.release()


async def test_a_stalled_body_is_cut_by_the_callers_timeout(serve, make_client):
    async def stall_in_body(conn: Conn) -> None:
        await conn.read_request()
        await conn.send(OK_HEAD + b"Content-Length: 10\r\n\r\n12")
        await conn.wait_eof()

    server = await serve(stall_in_body)
    client = make_client()
    resp = await post(client, server)
    async with within():
        assert await resp.readany() == b"12"
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.1):
            await resp.readany()
    resp.close()
    async with within():
        await server.connections[0].eof.wait()


# -- the per-endpoint pool limit and on_slot ----------------------------------------------


async def test_pool_limit_queues_requests_per_endpoint(serve, make_client):
    a = await serve(answer_every_request)
    b = await serve(answer_every_request)
    client = make_client(limit_per_endpoint=1)
    slots: list[str] = []
    first = await post(client, a, on_slot=lambda: slots.append("a1"))
    waiting = asyncio.create_task(
        client.post(a.url, "/v1/completions", b"{}", {}, on_slot=lambda: slots.append("a2"))
    )
    await asyncio.sleep(0.1)
    assert not waiting.done()  # held in the gateway's own pool: nothing was sent
    assert slots == ["a1"]
    assert len(a.requests) == 1

    other = await post(client, b, on_slot=lambda: slots.append("b1"))  # another endpoint: not blocked
    assert slots == ["a1", "b1"]
    async with within():
        await other.read()
    other.release()

    async with within():
        await first.read()
    first.release()
    async with within():
        second = await waiting
    assert slots == ["a1", "b1", "a2"]
    async with within():
        await second.read()
    second.release()
    assert len(a.requests) == 2
    assert len(a.connections) == 1  # the released connection carried the queued request


async def test_closing_a_response_twice_frees_its_slot_once(serve, make_client):
    server = await serve(answer_every_request)
    client = make_client(limit_per_endpoint=1)
    resp = await post(client, server)
    resp.close()
    resp.close()
    resp.release()
    slots: list[int] = []
    held = await post(client, server, on_slot=lambda: slots.append(1))
    blocked = asyncio.create_task(
        client.post(server.url, "/v1/completions", b"{}", {}, on_slot=lambda: slots.append(2))
    )
    await asyncio.sleep(0.1)
    assert slots == [1]  # still one request at a time
    assert not blocked.done()
    held.close()
    async with within():
        (await blocked).close()
    assert slots == [1, 2]


async def test_on_slot_runs_once_a_slot_is_held_even_without_a_limit(serve, make_client):
    server = await serve(answer_every_request)
    client = make_client(limit_per_endpoint=0)
    calls: list[int] = []

    def on_slot() -> None:
        calls.append(len(server.requests))  # runs before the request is written

    resp = await post(client, server, on_slot=on_slot)
    resp.close()
    assert calls == [0]


async def test_a_failed_send_gives_its_slot_back(serve, make_client):
    async def refuse_first(conn: Conn) -> None:
        if conn.index == 0:
            await conn.read_request()
            return
        await answer_every_request(conn)

    server = await serve(refuse_first)
    client = make_client(limit_per_endpoint=1)
    with pytest.raises(ConnectionLost):
        await post(client, server)
    resp = await post(client, server)  # would wait forever if the slot had leaked
    assert resp.status == 200
    resp.close()
